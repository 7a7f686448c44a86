"""Learned anchor and initial-state modules shared by SCSE and the adapter controls.

Listing 1: ``anchor = e + anchor_scale · anchor_proj(e)`` and ``H0(e) = e + init_delta_scale ·
init_delta_proj(e)``, both projections d×d and bias-free, both scales 0.1.

Anchor ablations (paper Table 2) choose ``h*``:
``learned`` (default, ``e + a(e)``), ``embedding`` (``h* = e``), ``init`` (``h* = H0(e)``, which
collapses Δ0 to zero) and ``frozen_random`` (same module shape as ``a``, random and never trained).
Ablations that need no anchor projection do not carry one.
"""

from __future__ import annotations

import torch
from torch import nn

from looplm.errors import LoopLMError
from looplm.model.recurrences.base import LoopContext

ANCHOR_MODES = ("learned", "embedding", "init", "frozen_random")
# Where the two projections start (the paper is silent): ``normal`` draws them like every other
# projection (N(0, model.init_std)); ``identity`` starts anchor_proj at 0 and init_delta_proj at I,
# so h* = e and Δ0 = init_delta_scale·e at step 0 (the token's own embedding, not a random
# projection of it, seeds the deviation).
PROJ_INITS = ("normal", "identity")


class AnchorInit(nn.Module):
    """Computes ``h*`` and ``H0(e)`` once per input."""

    def __init__(
        self,
        d_model: int,
        anchor: str = "learned",
        anchor_scale: float = 0.1,
        init_delta_scale: float = 0.1,
        proj_init: str = "normal",
    ) -> None:
        super().__init__()
        if anchor not in ANCHOR_MODES:
            raise LoopLMError(f"unknown anchor {anchor!r}; allowed: {', '.join(ANCHOR_MODES)}")
        if proj_init not in PROJ_INITS:
            raise LoopLMError(f"proj_init={proj_init!r}; allowed: {', '.join(PROJ_INITS)}")
        self.mode = anchor
        self.proj_init = proj_init
        self.anchor_scale = anchor_scale
        self.init_delta_scale = init_delta_scale
        self.init_delta_proj = nn.Linear(d_model, d_model, bias=False)
        if anchor in ("learned", "frozen_random"):
            self.anchor_proj = nn.Linear(d_model, d_model, bias=False)
            if anchor == "frozen_random":
                self.anchor_proj.weight.requires_grad_(False)
        else:
            self.anchor_proj = None

    @staticmethod
    def n_parameters(d_model: int, anchor: str = "learned") -> int:
        """init_delta_proj (d²), plus anchor_proj (d²) for a learned or frozen random anchor."""
        return d_model * d_model * (2 if anchor in ("learned", "frozen_random") else 1)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Called by the model after its generic initialisation (``proj_init``)."""
        if self.proj_init == "identity":
            nn.init.eye_(self.init_delta_proj.weight)
            if self.anchor_proj is not None and self.mode != "frozen_random":
                nn.init.zeros_(self.anchor_proj.weight)

    def initial(self, e: torch.Tensor) -> torch.Tensor:
        """H0(e) = e + 0.1 · init_delta_proj(e)."""
        return e + self.init_delta_scale * self.init_delta_proj(e)

    def anchor(self, e: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        """h* for the configured ablation."""
        if self.mode == "embedding":
            return e
        if self.mode == "init":
            return self.initial(e) if h0 is None else h0
        return e + self.anchor_scale * self.anchor_proj(e)

    def context(self, e: torch.Tensor) -> LoopContext:
        """The loop context every anchor-coordinate method starts from: e, h*, and H0(e) as ``h0``."""
        h0 = self.initial(e)
        return LoopContext(e=e, anchor=self.anchor(e, h0), extra={"h0": h0})
