"""The halting rules, one class each, registered by name: the one list every command, the server
and the adaptive analysis read.

A rule decides, after a loop step, which tokens (or, for a per-example rule, which examples) stop
looping. Its class states its name, a one-line ``summary``, where it can be used (``decoding``:
``looplm generate`` and ``looplm serve``; ``evaluation``: the adaptive-depth analysis) and its
threshold's allowed range; an instance is a decision that :class:`looplm.model.halting.
TokenHalting` (per token) or :class:`looplm.model.halting.ExampleHalting` (per example) asks.

========  ======================================================================  ============
name      halts when                                                              reads
========  ======================================================================  ============
kl        KL(p_t ‖ p_{t−1}) < threshold                                           logits
update    ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ < threshold                                 hidden
maxtoken  an example's largest relative token update < threshold (per example)    hidden
gate      the learned exit gate's cumulative exit probability ≥ threshold (Ouro)  hidden
router    a fitted linear router's P(converged | h_t) ≥ threshold                 hidden
========  ======================================================================  ============

A new rule is one class in one file: subclass :class:`HaltingRule`, give it a ``name`` and a
``summary``, implement ``__call__`` (and ``build`` if it needs more than a threshold), and
decorate it with ``@HALTING_RULES.register``; a module outside looplm is loaded from the
``looplm.halting`` entry-point group or ``$LOOPLM_PLUGINS`` (docs/extending.md has an example).
Light at import (torch loads when a decision runs): the command line lists the names at start-up.
"""

from __future__ import annotations

import math
import sys
from typing import Any, ClassVar

from looplm.errors import LoopLMError
from looplm.settings.plugins import Registry

# names that meant a rule under another name for one release: old → new
RENAMED = {"maxtoken": "update"}  # decoding's per-token relative update (generate --halt)


class HaltingRule:
    """Base class of a halting rule (a decision ``decide(t, h, cur, prev) -> (n,) bool``)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line: when a token (or example) halts
    per_token: ClassVar[bool] = True  # False: per example (stopped examples leave the batch)
    decoding: ClassVar[bool] = True  # usable by generate / serve
    evaluation: ClassVar[bool] = True  # a rule of the adaptive-depth analysis
    lo: ClassVar[float] = 0.0  # the threshold's allowed range [lo, hi]
    hi: ClassVar[float] = math.inf
    lo_open: ClassVar[bool] = False  # lo itself not allowed
    needs_logits: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    needs_tokens: ClassVar[bool] = False
    threshold: float

    @classmethod
    def check_threshold(cls, value: float) -> float:
        """``value`` inside the rule's range, else a one-line error naming both."""
        v = float(value)
        below = v <= cls.lo if cls.lo_open else v < cls.lo
        if math.isnan(v) or below or v > cls.hi:
            left = "(" if cls.lo_open else "["
            rng = f"{left}{cls.lo:g}, {cls.hi:g}]" if cls.hi < math.inf else f"{left}{cls.lo:g}, ∞)"
            raise LoopLMError(f"{cls.name} threshold {value!r} must be in {rng}")
        return v

    @classmethod
    def build(cls, threshold: float, model: Any = None, **extra: Any) -> HaltingRule:
        """The decision for one unroll of ``model`` at ``threshold``."""
        return cls(threshold)  # type: ignore[call-arg]

    @property
    def mode(self) -> str:
        """The rule and its threshold as stored in a result's identity."""
        return f"{self.name}:thr={self.threshold:g}"


HALTING_RULES: Registry[HaltingRule] = Registry("halting rule", "looplm.halting")


def halting_names(
    *, decoding: bool | None = None, evaluation: bool | None = None, plugins: bool = True
) -> tuple[str, ...]:
    """Registered rule names (in registration order), those usable where asked (``plugins=False``:
    without importing plugin modules)."""
    return tuple(
        name
        for name, cls in HALTING_RULES.items(plugins=plugins).items()
        if (decoding is None or cls.decoding == decoding)
        and (evaluation is None or cls.evaluation == evaluation)
    )


class RuleNames(tuple):
    """The names of a settings field's ``choices``, made at import time: iterating gives the
    rules registered so far (and ``extra`` / ``suffix``) without importing plugins, so the command
    line starts light and a plugin module may import the settings; asking whether a name is
    allowed also asks the plugins' rules."""

    where: dict[str, bool]

    def __new__(cls, *, extra: tuple[str, ...] = (), suffix: tuple[str, ...] = (), **where: bool):
        self = super().__new__(cls, (*extra, *halting_names(plugins=False, **where), *suffix))
        self.where = where
        return self

    def __contains__(self, name: object) -> bool:
        return tuple.__contains__(self, name) or name in halting_names(**self.where)


_noted: set[str] = set()


def halting_rule(name: str, *, decoding: bool | None = None) -> type[HaltingRule]:
    """The rule class of ``name``."""
    rules = HALTING_RULES.items()
    if name not in rules or (decoding is not None and rules[name].decoding != decoding):
        allowed = halting_names(decoding=decoding)
        raise LoopLMError(f"unknown halting rule {name!r}; allowed: {', '.join(allowed)}")
    return rules[name]


def decoding_rule(name: str) -> str:
    """A decoding rule's registered name: ``none`` kept, an old name mapped to its new one (with a
    one-line note on stderr, once per process; the old name is accepted for one release)."""
    if name in RENAMED:
        if name not in _noted:
            _noted.add(name)
            print(f"note: halting rule {name!r} is now called {RENAMED[name]!r}", file=sys.stderr)
        name = RENAMED[name]
    return name if name == "none" else halting_rule(name, decoding=True).name


@HALTING_RULES.register
class KLHalt(HaltingRule):
    """Halt when ``KL(p_t ‖ p_{t−1}) < threshold`` (reads the logits)."""

    name = "kl"
    summary = "KL between successive loops' predictions below the threshold"
    needs_logits = True

    def __init__(self, threshold: float) -> None:
        self.threshold = self.check_threshold(threshold)

    def __call__(self, t: int, h, logp, logp_prev):
        from looplm.model.readout import readout_kl

        return readout_kl(logp, logp_prev) < self.threshold  # (N,)


@HALTING_RULES.register
class UpdateHalt(HaltingRule):
    """Halt when the token's relative hidden update ``‖h_t − h_{t−1}‖ / ‖h_{t−1}‖ < threshold``."""

    name = "update"
    summary = "relative hidden update ‖h_t − h_t−1‖ / ‖h_t−1‖ below the threshold"
    evaluation = False
    needs_hidden = True

    def __init__(self, threshold: float) -> None:
        self.threshold = self.check_threshold(threshold)

    @property
    def mode(self) -> str:
        return f"maxtoken:thr={self.threshold:g}"  # one new token per row: the max-token rule

    def __call__(self, t: int, h, cur, prev):
        from looplm.model.halting import relative_update

        return relative_update(cur, prev) < self.threshold


@HALTING_RULES.register
class MaxTokenHalt(HaltingRule):
    """The paper's per-example rule: an example stops when the largest relative update of its
    scored tokens falls below ``threshold``; ``valid`` (B, L) marks the scored tokens. A decision
    for :class:`looplm.model.halting.ExampleHalting`: ``decide(t, h, h_prev, rows)``."""

    name = "maxtoken"
    summary = "an example's largest relative token update below the threshold (per example)"
    per_token = False
    decoding = False

    def __init__(self, threshold: float, valid) -> None:
        self.threshold, self.valid = self.check_threshold(threshold), valid

    @classmethod
    def build(cls, threshold: float, model: Any = None, **extra: Any) -> HaltingRule:
        return cls(threshold, extra["valid"])

    def __call__(self, t: int, h, h_prev, rows):
        from looplm.model.halting import max_token_updates

        return max_token_updates(h, h_prev, self.valid[rows]) < self.threshold  # (A,)


@HALTING_RULES.register
class GateHalt(HaltingRule):
    """Halt when the exit gate's cumulative exit probability reaches ``threshold``: after step t,
    ``c_t = c_{t−1} + λ_t · r_{t−1}``, ``r_t = r_{t−1} · (1 − λ_t)`` (c_0 = 0, r_0 = 1), i.e.
    ``c_t = 1 − Π_{j≤t}(1 − λ_j)`` summed in the reference's order; λ_t is the model's
    ``recurrence.exit_probability(h_t)`` (Ouro's learned exit gate). Reads neither logits nor
    previous states, but keeps each token's running sums (``needs_tokens``: it is told which
    tokens the active rows are)."""

    name = "gate"
    summary = "the learned exit gate's cumulative exit probability reaches the threshold (Ouro)"
    hi = 1.0
    needs_tokens = True

    def __init__(self, model: Any, threshold: float) -> None:
        self.gate = exit_gate(model)
        self.threshold = self.check_threshold(threshold)
        self.cdf = self.remaining = None

    @classmethod
    def build(cls, threshold: float, model: Any = None, **extra: Any) -> HaltingRule:
        return cls(model, threshold)

    def start(self, n: int, device) -> None:
        """A new unroll over n tokens."""
        import torch

        self.cdf = torch.zeros(n, device=device)
        self.remaining = torch.ones(n, device=device)

    def __call__(self, t: int, h, idx, _unused):
        lam = self.gate(h).float()  # (n,)
        rem = self.remaining[idx]
        cdf = self.cdf[idx] + lam * rem
        self.cdf[idx], self.remaining[idx] = cdf, rem * (1.0 - lam)
        return cdf >= self.threshold


def exit_gate(model: Any):
    """The model's learned exit gate ``h -> λ`` (Ouro's), or a one-line error for a model
    without one (asked before any work: ``serve --halt gate`` refuses at start)."""
    gate = getattr(getattr(model, "recurrence", None), "exit_probability", None)
    if gate is None:
        name = getattr(getattr(model, "config", None), "recurrence", type(model).__name__)
        raise LoopLMError(f"halt=gate needs a model with a learned exit gate (ouro); got {name}")
    return gate


@HALTING_RULES.register
class RouterHalt(HaltingRule):
    """The learned linear router baseline: halt when the router's P(converged | h_t) ≥ ``prob``
    (a router fitted on harvested convergence labels, :func:`looplm.adaptive.halting.fit_router`)."""

    name = "router"
    summary = "a fitted linear router's P(converged | h_t) reaches the threshold"
    decoding = False
    hi = 1.0
    lo_open = True

    def __init__(self, router: Any, prob: float = 0.5) -> None:
        try:
            self.prob = self.threshold = self.check_threshold(prob)
        except LoopLMError:
            raise LoopLMError(f"router probability threshold {prob!r} must be in (0, 1]") from None
        self.router = router

    @classmethod
    def build(cls, threshold: float, model: Any = None, **extra: Any) -> HaltingRule:
        return cls(extra["router"], threshold)

    @property
    def mode(self) -> str:
        return f"router:p={self.prob:g}"

    def __call__(self, t, h, logp, logp_prev):
        return self.router.prob(h) >= self.prob
