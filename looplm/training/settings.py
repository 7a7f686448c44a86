"""``looplm train``'s options as a settings dataclass (:mod:`looplm.settings.options` makes the
command line from it). The run itself is its config (:class:`looplm.settings.config.RunConfig`,
``CONFIG key=value …``); these say only how the command starts it."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.errors import LoopLMError


@dataclass
class TrainSettings:
    """``looplm train CONFIG``: continue, replace or start the run folder."""

    resume: bool = False  # continue from <out_dir>/ckpt exactly
    # start afresh even if <out_dir> already holds a checkpoint (it is replaced)
    overwrite: bool = False
    progress: bool = True  # show the progress bar (--no-progress hides it)

    def validate(self) -> None:
        """--resume and --overwrite ask for opposite things: one line naming both."""
        if self.resume and self.overwrite:
            raise LoopLMError(
                "--resume continues <out_dir>/ckpt and --overwrite replaces it; pick one"
            )
