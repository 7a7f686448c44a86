"""The settings of ``looplm diagnose``, its sweep kind and :func:`~looplm.diagnostics.runner.
diagnose_model`, one dataclass read by all three (:mod:`looplm.settings.options` makes the command line
from it), and the data a checkpoint analysis reads. Light on purpose (no torch): the command line
is built from these at start-up."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.device import DEVICES
from looplm.settings import setting

DTYPES = ("float64", "float32")  # working precisions of the diagnostics
EPS_FD = 1e-3  # finite-difference step of the random-direction gain (the paper's ε)
N_DIRECTIONS = 4  # random probe directions of the gain
DOSE_GAINS = (0.5, 1.0, 2.0)  # injection gains of the anchor-start dose-response
DEFAULT_KL_THRESHOLD = 1e-3  # τ of the per-token convergence depth


@dataclass
class DiagnoseSettings:
    """The mechanistic diagnostics of a looped model (paper defaults where the paper gives one)."""

    # unroll depth T (Table 3 uses 48)
    loops: int = setting(48, lo=1, loops=True, what="the loop depth T")
    batches: int = setting(2, lo=1, cap=10_000)  # measured batches
    batch_size: int = setting(4, lo=1, hi=65_536)  # sequences (full context windows) per batch
    # working precision (float64 keeps the ε = 1e-3 finite differences exact enough)
    dtype: str = setting("float64", choices=DTYPES)
    # τ of the per-token convergence depth
    kl_threshold: float = setting(DEFAULT_KL_THRESHOLD, lo=1e-12)
    steer_inputs: int = setting(6, lo=0, cap=10_000)  # inputs of the steering rollouts (paper: 6)
    check_steps: int = setting(4, lo=0, cap=4096)  # steps of the numerical Lemma 1 check (0: skip)
    seed: int = setting(0, lo=0)  # seed of the random probe directions
    # random probe directions of the gain
    n_dirs: int = setting(N_DIRECTIONS, lo=1, cap=10_000, cli=False)
    eps_fd: float = setting(EPS_FD, lo=1e-12, cli=False)  # finite-difference step of the gain
    # the largest trained depth (Figure 4's circle; "still updating at 8"; the command and the kind
    # take the checkpoint's)
    ref_depth: int = setting(8, lo=1, cli=False)
    # gains of the anchor-start dose-response
    dose_gains: tuple[float, ...] = setting(DOSE_GAINS, lo=0, cli=False)
    check_examples: int = setting(2, lo=1, cli=False)  # Lemma 1 check: examples
    check_tokens: int = setting(16, lo=1, cli=False)  # Lemma 1 check: tokens
    check_nodes: int = setting(8, lo=1, cli=False)  # quadrature nodes per panel (Gauss–Legendre)
    check_panels: int = setting(32, lo=1, cli=False)  # panels of the composite rule
    power_iters: int = setting(10, lo=0, cli=False)  # ‖A_t^sec‖₂ estimate for Corollary 3 (0: skip)


@dataclass
class DiagnosticsKindSettings(DiagnoseSettings):
    """The ``evaluate.diagnostics`` section: the diagnostics of every looped run of a sweep."""

    split: str = "test"  # split the measured windows come from


@dataclass
class DiagnoseOutput:
    """Where ``looplm diagnose`` runs and writes."""

    out: str = "runs/diagnostics"  # output folder
    store: str | None = None  # results store (.sqlite) to add one row per checkpoint to
    device: str = setting("auto", choices=DEVICES)  # auto | cpu | cuda
    # CPU threads for torch (tiny models on a busy CPU often run fastest with 1)
    threads: int | None = setting(None, lo=1, hi=1024)
    plots: bool = True  # write the figures (--no-plots: numbers only)
