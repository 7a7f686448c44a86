"""Parameter counts of every method at 22m and 136.5m against closed forms (the shared parts
written out here, what each recurrence adds declared by its class as ``parameter_formula``), and
against the figures the paper prints. Models are built on the meta device (no weights).

Paper figures and ours: step_conditioned at 136.5m 139.2M (ours 139,223,553); unshared 4×320 22.7M
(22,679,680), 6×288 22.5M (22,477,248); Transformer-8 38.23M (38,228,736). The paper's "136.5M"
SCSE and "95.6M" shared-block LM equal the tuned-adapter layout here (136,454,657 / 95,626,241);
the core SCSE carries one d×d matrix fewer (133,685,760 / 93,987,840) — see tests/test_model.py.
"""

from __future__ import annotations

import argparse

import pytest

import looplm
from looplm.model.accounting import parameter_count
from looplm.model.recurrences import get_recurrence_class
from looplm.model.recurrences.base import build_config
from looplm.settings.config import PRESETS, UNSHARED

V, C = 50257, 128  # GPT-2 vocabulary, context


def _block(d: int, ff: int) -> int:
    return 4 * d * d + 3 * d * ff + 2 * d  # qkv + proj, SwiGLU gate/up/down, two RMSNorm gains


def expected(name: str, preset: str, **settings) -> int:
    """Embedding + block(s) + final norm written out here, plus the closed form the recurrence
    class declares for what it adds (``parameter_formula``, at its settings)."""
    p = PRESETS[preset]
    d, ff = p["d_model"], p["d_ff"]
    emb = V * d + C * d
    if name == UNSHARED:
        return emb + p.get("n_layers", 8) * _block(d, ff) + d
    cls = get_recurrence_class(name)
    extra = cls.parameter_formula(d, build_config(cls, settings))
    assert extra is not None, f"{name} declares no parameter_formula (its closed form)"
    return emb + _block(d, ff) + d + extra


NAMES = looplm.recurrence_names()


@pytest.mark.parametrize("preset", ["22m", "136.5m"])
@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_the_closed_form(name, preset):
    got = parameter_count(preset, name)
    want = expected(name, preset)
    assert abs(got["total"] - want) <= 1e-3 * want  # 0.1%, the specification's tolerance …
    assert got["total"] == want  # … and in fact exactly (a new method needs its closed form)
    frozen = PRESETS[preset]["d_model"] if name == "hrm_text" else 0  # z₀, never trained
    assert got["trainable"] == got["total"] - frozen


@pytest.mark.parametrize(
    "name, settings",
    [
        ("scse", {"anchor": "embedding"}),
        ("scse", {"anchor": "init"}),
        ("looped", {"learn_gain": True}),
        ("capacity_matched", {"w_in": True}),
        ("step_film", {"step_embedding": "sinusoidal"}),
        ("step_film", {"n_steps": 5}),
        ("forcing_subtraction", {"step_tau": 0.015}),
        ("hyper_scse", {"lanes": 2, "anchor": "embedding"}),
        ("hyper_looped", {"lanes": 3}),
    ],
)
def test_declared_closed_forms_follow_the_settings(name, settings):
    assert parameter_count("22m", name, **settings)["total"] == expected(name, "22m", **settings)


# ---------------------------------------------------------------------- the paper's figures


def _printed(count: int, value_m: float, decimals: int) -> bool:
    return round(count / 1e6, decimals) == value_m


def test_step_conditioned_at_136_5m_matches_the_paper():
    """Paper: 'the largest recurrent-step-conditioned control has 139.2M parameters'."""
    n = parameter_count("136.5m", "step_conditioned")["total"]
    assert n == 139_223_553
    assert _printed(n, 139.2, 1) and abs(n - 139.2e6) <= 1e-3 * 139.2e6


@pytest.mark.parametrize(
    "preset, exact_m, printed_m",
    [
        ("22m-unshared-4x320", 22.68, 22.7),  # paper: 4-layer 22.7M Transformer, width 320
        ("22m-unshared-6x288", 22.48, 22.5),  # paper: 6-layer 22.5M Transformer, width 288
        (
            "22m-unshared-8x384",
            38.23,
            None,
        ),  # Transformer-8 reference (38.23M, looplm's specification)
        ("22m", 38.23, None),  # `unshared` at 22m is the same Transformer-8 (n_layers = 8)
    ],
)
def test_unshared_controls_match_the_paper(preset, exact_m, printed_m):
    n = parameter_count(preset, "unshared")["total"]
    assert abs(n - exact_m * 1e6) <= 1e-3 * exact_m * 1e6
    assert _printed(n, exact_m, 2)
    if printed_m is not None:
        assert _printed(n, printed_m, 1)


def test_unshared_head_counts_divide_the_width():
    for preset in ("22m-unshared-4x320", "22m-unshared-6x288", "22m-unshared-8x384"):
        p = PRESETS[preset]
        assert p["d_model"] % p["n_heads"] == 0 and p["d_ff"] == 4 * p["d_model"]


@pytest.mark.parametrize("preset", ["22m", "136.5m"])
def test_capacity_matched_matches_scse_to_0_1_percent(preset):
    cm = parameter_count(preset, "capacity_matched")["total"]
    scse = parameter_count(preset, "scse")["total"]
    assert abs(cm - scse) <= 1e-3 * scse
    full = parameter_count(preset, "capacity_matched", w_in=True)["total"]
    assert full == parameter_count(preset, "tuned_adapter")["total"]


def test_frozen_random_anchor_is_counted_but_not_trainable():
    got = parameter_count("22m", "scse", anchor="frozen_random")
    assert got["total"] == expected("scse", "22m")
    assert got["trainable"] == got["total"] - 384 * 384


# ---------------------------------------------------------------------- `looplm params`


def _params_cli(argv: list[str]) -> int:
    from looplm.commands import methods

    parser = argparse.ArgumentParser()
    methods.register(parser.add_subparsers())
    args = parser.parse_args(["params", *argv])
    return args.func(args)


def test_params_command(capsys):
    assert _params_cli(["--preset", "136.5m", "--method", "step_conditioned"]) == 0
    out = capsys.readouterr().out
    assert "139,223,553" in out and "paper: 139.2M" in out and "matches" in out
    assert _params_cli(["--preset", "22m", "--method", "hyper_scse", "lanes=2"]) == 0
    assert f"{expected('scse', '22m') + 2 + 4 + 2:,}" in capsys.readouterr().out


def test_params_command_errors():
    with pytest.raises(looplm.LoopLMError, match="unknown recurrence"):
        _params_cli(["--method", "nope"])
    with pytest.raises(looplm.LoopLMError, match="lanez"):
        _params_cli(["--method", "hyper_scse", "lanez=2"])
    with pytest.raises(looplm.LoopLMError, match="key=value"):
        _params_cli(["--method", "hyper_scse", "lanes"])
