"""FLOP accounting (Eqs. 20–21): the paper's printed figures, c_body and the unshared min(T, N)."""

from __future__ import annotations

import pytest

import looplm
from looplm.errors import LoopLMError
from looplm.model.recurrences import get_recurrence_class
from looplm.settings.config import UNSHARED

V = 50257


def _m(x: int) -> str:
    return f"{x / 1e6:.1f}"


def _eq20(d: int, ff: int, L: int, n_body: int) -> int:
    return n_body * (8 * d * d + 6 * d * ff + 4 * L * d)


@pytest.mark.parametrize(
    "preset, loops, body_m, body_head_m",
    [
        ("22m", 8, "39.3", "77.9"),  # Appendix 'Compute and Token-Budget Accounting'
        ("22m", 48, "235.9", "274.5"),
        ("95.6m", 8, None, "553.3"),  # Table 7 caption
    ],
)
def test_paper_figures(preset, loops, body_m, body_head_m):
    f = looplm.flops(preset, "scse", loops)
    if body_m is not None:
        assert _m(f["body"]) == body_m
    assert _m(f["body_head"]) == body_head_m


def test_exact_values_from_the_equations():
    f = looplm.flops("22m", "scse", 8)
    assert f["body"] == _eq20(384, 1536, 128, 8) == 39_321_600
    assert f["head"] == 2 * 384 * V
    assert f["body_head"] == f["body"] + f["head"]
    g = looplm.flops("95.6m", "tuned_adapter", 8, seq_len=1024)
    assert g["body"] == _eq20(1280, 5120, 1024, 8)


def test_c_body_doubles_the_body_for_the_subtractive_controls():
    two = {
        n
        for n in looplm.recurrence_names()
        if n != UNSHARED and looplm.flops("22m", n, 8)["c_body"] == 2
    }
    # HRM-Text: (3 + 1) applications of half its core per step (the published split core)
    assert two == {"forcing_subtraction", "sc_cond_subtractive", "hrm_text"}
    for name in two:
        f, s = looplm.flops("22m", name, 48), looplm.flops("22m", "scse", 48)
        assert f["body"] == 2 * s["body"] and f["head"] == s["head"]
        assert f["c_body"] == get_recurrence_class(name).body_calls_per_step
        assert f["n_body"] == 96


def test_unshared_body_saturates_at_its_depth():
    t8 = [looplm.flops("22m", "unshared", T)["body"] for T in (3, 8, 48)]
    assert t8 == [_eq20(384, 1536, 128, 3), _eq20(384, 1536, 128, 8), _eq20(384, 1536, 128, 8)]
    assert (
        looplm.flops("22m", "unshared", 48)["body_head"]
        == looplm.flops("22m", "scse", 8)["body_head"]
    )
    f = looplm.flops("22m-unshared-4x320", "unshared", 8)
    assert f["n_body"] == 4 and f["body"] == _eq20(320, 1280, 128, 4)
    assert f["head"] == 2 * 320 * V
    assert looplm.flops("22m-unshared-6x288", "unshared", 2)["n_body"] == 2


@pytest.mark.parametrize(
    "args, match",
    [
        (("22m", "scse", 0), "loops"),
        (("22m", "scse", 2.5), "loops"),
        (("22m", "scse", 8, 0), "seq_len"),
        (("7b", "scse", 8), "preset"),
        (("22m", "nope", 8), "recurrence"),
    ],
)
def test_bad_input_raises(args, match):
    with pytest.raises(LoopLMError, match=match):
        looplm.flops(*args)


def test_flops_stays_a_function_after_importing_the_accounting_module():
    from looplm.model.accounting import parameter_count  # noqa: F401

    assert looplm.flops("22m", "scse", 8)["body"] == 39_321_600
