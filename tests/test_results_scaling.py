"""Recurrence scaling law fit: recovery of known parameters and clear errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest

from looplm.errors import LoopLMError
from looplm.results.store import EvalRecord
from looplm.scaling.fit import fit_records, fit_recurrence_scaling, scaling_points

TRUE = {"E": 1.8, "A": 300.0, "alpha": 0.30, "B": 600.0, "beta": 0.30, "phi": 0.46}


def iso_depth_sweep(params: dict, noise: float = 0.0, seed: int = 0, budgets=(2e9, 6e9, 2e10)):
    """Iso-depth sweep: total depth 8 = (8 / r) unique layers looped r times, r in {1, 2, 4, 8},
    four layer sizes, three token budgets; loss from the law (times log-normal noise)."""
    rows = []
    for p_layer in (2e6, 6e6, 1.8e7, 5e7):
        for r in (1, 2, 4, 8):
            for d in budgets:
                n_once = 2e4 * p_layer**0.5  # embeddings/head grow with width
                n_rec = 8 / r * p_layer
                rows.append((r, n_once, n_rec, d))
    r, n_once, n_rec, d = (np.array(c, dtype=float) for c in zip(*rows))
    n_eff = n_once + r ** params["phi"] * n_rec
    loss = (
        params["E"] + params["A"] * n_eff ** -params["alpha"] + params["B"] * d ** -params["beta"]
    )
    loss = loss * np.exp(np.random.default_rng(seed).normal(0.0, noise, loss.size))
    return r, n_once, n_rec, d, loss


def test_recovers_known_parameters_exactly_without_noise():
    fit = fit_recurrence_scaling(*iso_depth_sweep(TRUE))
    for k, v in TRUE.items():
        assert getattr(fit, k) == pytest.approx(v, rel=1e-3), k
    assert fit.rmse_log < 1e-6 and fit.n_points == 48


@pytest.mark.parametrize("phi", [0.2, 0.8])
def test_recovers_other_phi(phi):
    params = dict(TRUE, phi=phi)
    fit = fit_recurrence_scaling(*iso_depth_sweep(params), robust="linear", n_starts=16)
    assert fit.phi == pytest.approx(phi, abs=2e-3)


def test_recovers_phi_under_noise():
    fit = fit_recurrence_scaling(*iso_depth_sweep(TRUE, noise=0.002, seed=3))
    assert fit.phi == pytest.approx(0.46, abs=0.05)
    assert 0.001 < fit.rmse_log < 0.004  # about the injected 0.2 % noise
    r, once, rec, d, loss = iso_depth_sweep(TRUE)
    pred = fit.predict(r, once, rec, d)
    assert np.max(np.abs(np.log(pred / loss))) < 0.01


def test_fixed_parameters_when_all_runs_share_one_budget():
    params = dict(TRUE, B=0.0)
    data = iso_depth_sweep(params, budgets=(5e9,))
    with pytest.raises(LoopLMError, match="one token budget"):
        fit_recurrence_scaling(*data)
    fit = fit_recurrence_scaling(*data, fixed={"B": 0.0, "beta": 1.0})
    assert fit.phi == pytest.approx(0.46, abs=2e-3) and fit.B == 0.0


def test_bad_input_raises_clear_errors():
    r, once, rec, d, loss = iso_depth_sweep(TRUE)
    with pytest.raises(LoopLMError, match="more points than free parameters"):
        fit_recurrence_scaling(r[:5], once[:5], rec[:5], d[:5], loss[:5])
    with pytest.raises(LoopLMError, match="differ in length"):
        fit_recurrence_scaling(r, once, rec, d, loss[:-1])
    one_r = r == 4
    with pytest.raises(LoopLMError, match="distinct recurrence counts"):
        fit_recurrence_scaling(r[one_r], once[one_r], rec[one_r], d[one_r], loss[one_r])
    with pytest.raises(LoopLMError, match="loss > 0"):
        fit_recurrence_scaling(r, once, rec, d, -loss)
    with pytest.raises(LoopLMError, match="non-finite"):
        fit_recurrence_scaling(r, once, rec, d, loss * np.nan)
    with pytest.raises(LoopLMError, match="unknown fixed"):
        fit_recurrence_scaling(r, once, rec, d, loss, fixed={"gamma": 1.0})
    with pytest.raises(LoopLMError, match="robust"):
        fit_recurrence_scaling(r, once, rec, d, loss, robust="cauchy")


def _sweep_records(extra, protocol=lambda i: "isodepth8", **fields):
    """The simulated sweep of :data:`TRUE` as store records (``extra(i, r)`` adds fields)."""
    r, once, rec, d, loss = iso_depth_sweep(TRUE)
    return [
        EvalRecord(
            method="looped",
            model_hash=f"m{i}",
            protocol=protocol(i),
            depth=int(ri),
            seed=0,
            n_tokens=1000,
            sum_nll=float(li) * 1000,
            extra={"n_once": oi, "n_rec": ni, "train_tokens": di} | extra(i, ri),
            **fields,
        )
        for i, (ri, oi, ni, di, li) in enumerate(zip(r, once, rec, d, loss))
    ]


def test_points_from_store_records():
    r, once, rec, d, loss = iso_depth_sweep(TRUE)
    records = _sweep_records(lambda i, ri: {"r": int(ri)} if i % 2 else {})
    pts = scaling_points(records)
    np.testing.assert_allclose(pts["r"], r)
    np.testing.assert_allclose(pts["loss"], loss, rtol=1e-12)
    fit = fit_records(records, robust="linear", n_starts=8)
    assert fit.phi == pytest.approx(0.46, abs=2e-3)
    with pytest.raises(LoopLMError, match="not a scaling point"):
        scaling_points([EvalRecord(method="x", depth=1, seed=0, n_tokens=1, sum_nll=1.0)])


@pytest.mark.parametrize("phi", [0.38, 0.65])
def test_bootstrap_interval_covers_a_simulated_phi(phi):
    from looplm.scaling.fit import bootstrap_interval

    params = dict(TRUE, phi=phi)
    data = iso_depth_sweep(params, noise=0.003, seed=11)
    ci = bootstrap_interval(*data, n_boot=40, seed=1, robust="linear")
    assert ci.low <= phi <= ci.high, ci
    assert ci.high - ci.low < 0.3 and ci.n_failed == 0
    assert ci.low <= ci.estimate <= ci.high
    other = 0.46 if phi != 0.46 else 0.8
    wrong = iso_depth_sweep(dict(TRUE, phi=other), noise=0.003, seed=11)
    ci2 = bootstrap_interval(*wrong, n_boot=40, seed=1, robust="linear")
    assert not ci2.low <= phi <= ci2.high  # the interval moves with the data's phi


def test_report_fits_one_law_per_method_across_a_sweeps_variants(tmp_path):
    """A sweep's training variants carry their own protocol (``phi-d32-s100-r1``, …) but one
    ``sweep_protocol``: the report fits one law over all of them, not one per variant."""
    import json

    from looplm.results.report import write_report
    from looplm.results.store import ResultsStore

    r = iso_depth_sweep(TRUE)[0]
    store = ResultsStore(tmp_path / "results.sqlite")
    store.put_many(
        _sweep_records(
            lambda i, ri: {"r": int(ri), "sweep_protocol": "isodepth8"},
            protocol=lambda i: f"isodepth8-v{i}",
            split="validation",
            eval_tag="scaling",
        )
    )
    write_report(tmp_path / "results.sqlite", tmp_path / "report", reference="looped", seeds=[0])
    fits = json.loads((tmp_path / "report" / "results.json").read_text())["scaling"]
    assert len(fits) == 1 and fits[0]["context"]["protocol"] == "isodepth8", fits
    assert fits[0]["fit"]["n_points"] == len(r)
    assert fits[0]["fit"]["phi"] == pytest.approx(0.46, abs=0.02)
    lo, hi = fits[0]["phi_interval"]["low"], fits[0]["phi_interval"]["high"]
    assert lo - 1e-6 <= 0.46 <= hi + 1e-6
