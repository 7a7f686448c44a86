"""The recurrence interface and registry.

A recurrence is one small ``nn.Module`` per method. It owns that method's parameters (anchor
projections, gains, step embeddings) and defines, in its own state coordinates:

    prepare(e)                 -> LoopContext      once per input (anchor h*, e, …)
    init_state(ctx)            -> state            state at t = 0
    step(block, state, ctx, t) -> state            one loop step (calls ``block`` c_body times)
    to_hidden(state, ctx)      -> h                hidden-state coordinates (for readout, states)
    from_hidden(h, ctx)        -> state
    exit(h)                    -> coda input           (identity by default)

``block`` is the bound core: ``block(x)`` = G(x), ``advance(block, x)`` = x + G(x), and
``block.part(i, n)`` the same for part i of n equal runs of a k-layer core's layers (a loop of
several stacks, e.g. HRM-Text's two).

Adding a method = one file with a subclass decorated by ``@register``, in this folder (found by
a package scan) or anywhere else as a plugin (:mod:`looplm.settings.plugins`); ``LoopedLM`` never changes.
The class also declares what the tests check it against: its equation and paper reference,
whether its forcing bias is zero by construction (masked and raw), and the closed form of the
parameters it adds (:meth:`Recurrence.parameter_formula`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.settings import build_settings
from looplm.settings.config import UNSHARED
from looplm.settings.plugins import Registry

_REGISTRY: Registry[Recurrence] = Registry("recurrence", "looplm.recurrences")


@dataclass
class LoopContext:
    """What a recurrence needs per input: the embedding ``e``, the anchor ``h*`` and extras."""

    e: torch.Tensor  # (B, L, d)
    anchor: torch.Tensor  # (B, L, d) — h*, fixed through the unroll
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class NoConfig:
    """A recurrence without settings of its own."""


class Recurrence(nn.Module):
    """Base class; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    Config: ClassVar[type] = NoConfig
    body_calls_per_step: ClassVar[int] = 1  # c_body in the FLOP accounting (Eqs. 20–21)
    equation: ClassVar[str] = ""
    reference: ClassVar[str] = ""
    zero_forcing_bias: ClassVar[bool] = False  # b_t(e) = 0 exactly by construction
    zero_raw_forcing_bias: ClassVar[bool] = False  # the raw pre-mask b̃_t(e) = 0 exactly, too
    # False when some parameter sits out some steps (e.g. a gain used only every k-th loop), so
    # distributed data parallelism must look for unused parameters.
    uses_all_parameters: ClassVar[bool] = True

    def __init__(self, d_model: int, cfg: Any) -> None:
        super().__init__()
        self.d_model = d_model
        self.cfg = cfg
        # Evaluation-time multiplier on the injected source term (dose-response diagnostic);
        # 1.0 is the trained model. Methods without source injection ignore it.
        self.source_gain = 1.0

    @classmethod
    def parameter_formula(cls, d_model: int, cfg: Any) -> int | None:
        """Closed form of the parameters this recurrence adds to embedding + block + final norm
        at width ``d_model`` and settings ``cfg``, written from the equation (not counted from
        the modules); the parameter-count test checks it. None: not declared."""
        return None

    # -- contract -------------------------------------------------------------------------
    def prepare(self, e: torch.Tensor) -> LoopContext:
        return LoopContext(e=e, anchor=e)

    def init_state(self, ctx: LoopContext) -> torch.Tensor:
        raise NotImplementedError

    def step(
        self, block: nn.Module, state: torch.Tensor, ctx: LoopContext, t: int, *, mask: bool = True
    ) -> torch.Tensor:
        """One loop step. ``mask=False`` returns the raw pre-mask map (for b̃_t diagnostics)."""
        raise NotImplementedError

    def to_hidden(self, state: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return state

    def from_hidden(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        return h

    def exit(self, h: torch.Tensor) -> torch.Tensor:
        """The map from the final hidden state to the coda's input (identity unless a method
        defines one, e.g. a projection out of the loop)."""
        return h

    def no_decay_parameters(self) -> list[nn.Parameter]:
        """Parameters exempt from weight decay (scalar gains); ≤1-D tensors are exempt anyway."""
        return []


def advance(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x + G(x)`` through a bound core: its layers' own order when it offers one
    (:meth:`looplm.model.block.BlockCall.advance`), else ``x + block(x)``."""
    step = getattr(block, "advance", None)
    return step(x) if step is not None else x + block(x)


def register(cls: type[Recurrence]) -> type[Recurrence]:
    """Class decorator adding a recurrence to the registry under ``cls.name``."""
    return _REGISTRY.register(cls)


def recurrence_names() -> list[str]:
    """Registered recurrence names, plus ``unshared`` (the ordinary N-layer Transformer)."""
    return sorted(_REGISTRY.items()) + [UNSHARED]


def get_recurrence_class(name: str) -> type[Recurrence]:
    """The class registered as ``name`` (LoopLMError naming the allowed ones)."""
    classes = _REGISTRY.items()
    if name not in classes:
        raise LoopLMError(f"unknown recurrence {name!r}; allowed: {', '.join(recurrence_names())}")
    return classes[name]


def build_config(cls: type[Recurrence], args: dict[str, Any]) -> Any:
    """Validate ``args`` against the recurrence's ``Config`` dataclass (its settings under
    ``model.recurrence_args``)."""
    return build_settings(
        cls.Config,
        args,
        "model.recurrence_args",
        unknown=lambda key, allowed: (
            f"unknown setting {key!r} for recurrence {cls.name!r}; allowed: {allowed}"
        ),
    )


def build_recurrence(name: str, d_model: int, args: dict[str, Any]) -> Recurrence:
    """Instantiate the recurrence ``name`` for width ``d_model`` with its settings ``args``."""
    cls = get_recurrence_class(name)
    return cls(d_model, build_config(cls, args))
