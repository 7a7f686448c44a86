"""The settings of the lens analyses, one dataclass each, read by the command, the sweep kind and
the library alike (:mod:`looplm.settings.options` makes the command line from them).

* :class:`LensSettings` — ``looplm lens`` and :func:`looplm.lens.analysis.analyse_lens`;
* :class:`LensInputs` — what ``looplm lens`` draws the prompts from and where it writes;
* :class:`TwoHopLensSettings` — the ``evaluate.lens`` section (:mod:`looplm.lens.kind`).

The fit settings both analyses share (:class:`LensFit`) are stated once. Light on purpose (no
torch): the command line is built from these at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from looplm.errors import LoopLMError
from looplm.settings import depth_list, setting

ESTIMATORS = ("exact", "hutchinson")  # exact Jacobian-vector products | Hutchinson probes
INTERVENTIONS = ("swap", "steer", "project")  # the dose-responses of lens.interventions
ARMS = ("jlens", "logit", "tuned")  # the readouts the two-hop lens compares
REFERENCE_BAND = (0.38, 0.92)  # the workspace band of the original study, as fractions of depth
MAX_LOOPS = 512  # soft cap on lens depths: a fit costs about T backward passes per prompt


@dataclass
class LensFit:
    """Settings of the lens fits that every lens analysis shares."""

    k: int = setting(8, lo=1, hi=4096)  # subspace dimension of the workspace structure
    # Adam steps of the tuned lens per depth (the lens findings of docs/lens.md used 100)
    tuned_steps: int = setting(100, lo=0, cap=100_000)


@dataclass
class LensSettings(LensFit):
    """``looplm lens``: the Jacobian lens of one checkpoint (:func:`~looplm.lens.analysis.
    analyse_lens`, which also checks them against the model)."""

    # depth T of the fit (default: the largest training depth; an unshared model's layer count)
    loops: int | None = setting(None, lo=1, cap=MAX_LOOPS, loops=True, what="the loop depth T")
    # deeper depths to fit and evaluate too ('' for none; unshared models: none)
    extrapolate: tuple[int, ...] = setting((24, 48), lo=1, cap=MAX_LOOPS, loops=True)
    mode: str = setting("exact", choices=ESTIMATORS)  # estimator at T
    # estimator at the extrapolated depths
    extrapolate_mode: str = setting("exact", choices=ESTIMATORS)
    probes: int = setting(16, lo=1, cap=4096)  # Hutchinson probes per prompt
    skip_positions: int = setting(0, lo=0)  # leave the first positions out as sources
    # intervention band FIRST,LAST of loop steps (default: 38–92% of T, the original study's
    # workspace band); a grid's lens band is fractions of T, so this one is named in steps
    band_steps: tuple[int, int] | None = setting(None, lo=0, renamed=("band",))
    # dose-responses to run: swap, steer, project ('' for none)
    interventions: tuple[str, ...] = setting(("swap",), choices=INTERVENTIONS)
    strengths: tuple[float, ...] = setting((0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0), lo=0)  # doses
    composition: bool = True  # fit the one-step Jacobians (costs about one exact fit)
    # also fit a lens per layer of the virtually unrolled graph at T (prelude, every core layer of
    # every loop step, coda; costs about one fit at T per core layer)
    layers: bool = False
    seed: int = setting(0, lo=0)  # seed of probes, subsamples, bootstrap
    n_boot: int = setting(2000, lo=1, cap=1_000_000)  # bootstrap resamples of the intervals
    plots: bool = True  # write the figures (--no-plots: numbers only)
    corpus: str = setting("", cli=False)  # where the prompts came from (recorded in lens.json)
    progress: bool = setting(True, cli=False)  # print what is being fitted
    slice_prompt: int = setting(0, lo=0, cli=False)  # the held-out prompt the slice figure shows
    extra: dict[str, Any] = setting({}, cli=False)  # recorded in lens.json as given


@dataclass
class LensInputs:
    """``looplm lens``: the prompts (drawn from the checkpoint's data, see
    :class:`looplm.diagnostics.settings.DataSettings`) and the output."""

    out: str  # output folder
    prompts: int = setting(16, lo=1, cap=100_000)  # fitting prompts
    eval_prompts: int = setting(32, lo=1, cap=100_000)  # held-out prompts
    batch_size: int = setting(16, lo=1, hi=65_536)  # prompts per batch
    # a saved Jacobian lens (lens_T{T} folder) to use at T instead of fitting
    lens: str | None = None
    threads: int | None = setting(None, lo=1, hi=1024)  # CPU threads for torch


@dataclass
class TwoHopLensSettings(LensFit):
    """The ``evaluate.lens`` section: the Jacobian lens on the two-hop knowledge task."""

    loops: int = setting(
        8, lo=1, cap=MAX_LOOPS, loops=True, what="the loop depth T"
    )  # depth T of the fit
    extrapolate: list[int] = setting([], lo=1, cap=MAX_LOOPS, loops=True)  # deeper depths read too
    n_fit: int = setting(128, lo=1, cap=100_000)  # prompts of training text the arms are fit on
    # swap band, fractions of T (0 <= lo <= hi <= 1, checked as a pair)
    band: list[float] = setting(list(REFERENCE_BAND), lo=0)
    extra_bands: list[list[float]] = setting([], lo=0)  # further swap bands, fractions of T
    arms: list[str] = setting(list(ARMS), choices=ARMS)  # readouts compared (jlens required)
    swap_depths: list[int] | None = setting(None, lo=1)  # depths of the swap test (default: loops)
    batch_size: int = setting(512, lo=1, hi=65_536)  # prompts per forward pass

    def validate(self) -> None:
        self.extrapolate = (
            depth_list(self.extrapolate, "lens.extrapolate", ceiling=False)
            if self.extrapolate
            else []
        )
        if any(T <= self.loops for T in self.extrapolate):
            raise LoopLMError(
                f"evaluate.lens.extrapolate={self.extrapolate}: extrapolated depths must exceed "
                f"loops={self.loops}"
            )
        fractions(self.band, "band")
        for b in self.extra_bands:
            fractions(b, "extra_bands")
        if "jlens" not in self.arms:
            raise LoopLMError(
                f"evaluate.lens.arms={self.arms}; allowed: {', '.join(ARMS)} (jlens required)"
            )
        swaps = depth_list(self.swap_depths or [self.loops], "lens.swap_depths", ceiling=False)
        unknown = sorted(set(swaps) - {self.loops, *self.extrapolate})
        if unknown:
            raise LoopLMError(
                f"evaluate.lens.swap_depths has depth {unknown[0]}, which is not a lens depth "
                f"(loops or extrapolate: {[self.loops, *self.extrapolate]})"
            )
        self.swap_depths = swaps


def fractions(band: Any, key: str) -> tuple[float, float]:
    """A band of loop steps given as two fractions of T, ``0 <= lo <= hi <= 1``."""
    if (
        not isinstance(band, (list, tuple))
        or len(band) != 2
        or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in band)
        or not 0 <= band[0] <= band[1] <= 1
    ):
        raise LoopLMError(
            f"evaluate.lens.{key}: band {band!r} must be two fractions of T, 0 <= lo <= hi <= 1"
        )
    return float(band[0]), float(band[1])
