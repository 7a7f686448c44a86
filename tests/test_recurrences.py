"""Every registered recurrence builds, trains, is deterministic in eval mode and round-trips through a
checkpoint; SCSE anchor ablations; recurrence settings; the `looplm methods` listing."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import looplm
from looplm.errors import LoopLMError
from looplm.model import build_model
from looplm.model.checkpoint import load_checkpoint, save_checkpoint
from looplm.settings.config import UNSHARED, RunConfig

NAMES = looplm.recurrence_names()
VOCAB = 257  # tiny preset (bytes)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are dispatch-bound: one intra-op thread is faster and spares shared CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _batch(seed: int = 0, B: int = 4, L: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (B, L + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _tiny(name: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("tiny", name, **{"dropout": 0.0, **kw})


def _unused_at_depth(name: str, model: torch.nn.Module, loops: int) -> set[str]:
    """Parameters that legitimately get no gradient at this depth."""
    if name == UNSHARED:
        return {n for n, _ in model.named_parameters() if n.startswith("layers.")} - {
            n
            for n, _ in model.named_parameters()
            for i in range(loops)
            if n.startswith(f"layers.{i}.")
        }
    if name == "norm_reset" and loops < model.recurrence.cfg.period:
        return {"recurrence.reset_gain"}
    if name == "ouro":  # the exit gate is read by halting, not by the loss
        return {"recurrence.exit_gate.weight", "recurrence.exit_gate.bias"}
    return set()


def test_every_method_is_listed():
    expected = {
        "scse", "looped", "tuned_adapter", "capacity_matched", "step_conditioned", "step_film",
        "norm_reset", "sc_cond", "sc_cond_nomask", "forcing_subtraction", "sc_cond_subtractive",
        "scse_leak", "gated", "hyper_looped", "hyper_scse", "unshared",
    }  # fmt: skip
    assert expected <= set(NAMES)


@pytest.mark.parametrize("name", [n for n in NAMES if n != UNSHARED])  # unshared: a model
def test_declares_its_equation(name):
    from looplm.model.recurrences import get_recurrence_class

    cls = get_recurrence_class(name)
    assert cls.equation and cls.reference
    assert cls.body_calls_per_step in (1, 2)
    assert isinstance(cls.zero_forcing_bias, bool)


@pytest.mark.parametrize("loops", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name, loops):
    model = _tiny(name)
    ids, tgt = _batch()
    logits = model(ids, loops=loops)
    assert logits.shape == (*ids.shape, VOCAB)
    assert torch.isfinite(logits).all()
    loss = model.loss(ids, tgt, loops=loops)
    loss.backward()
    assert torch.isfinite(loss)
    skip = _unused_at_depth(name, model, loops)
    missing = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad
        and n not in skip
        and (p.grad is None or not torch.isfinite(p.grad).all())
    ]
    assert not missing, f"{name} T={loops}: no/finite gradient for {missing}"
    if loops == 3:  # every recurrence parameter is connected to the loss
        silent = [
            n
            for n, p in model.named_parameters()
            if n.startswith("recurrence.")
            and n not in skip
            and p.requires_grad
            and p.grad.abs().sum() == 0
        ]
        assert not silent, f"{name}: zero gradient for {silent}"


@pytest.mark.parametrize("name", NAMES)
def test_eval_mode_is_deterministic(name):
    model = _tiny(name, dropout=0.1).eval()  # dropout must switch off in eval mode
    ids, _ = _batch(1)
    with torch.no_grad():
        a, b = model(ids, loops=3), model(ids, loops=3)
    assert torch.equal(a, b)


@pytest.mark.parametrize("name", NAMES)
def test_trains_on_a_fixed_batch(name):
    model = _tiny(name, seed=1)
    ids, tgt = _batch(2, B=2, L=16)
    with torch.no_grad():
        start = float(model.loss(ids, tgt, loops=3))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for step in range(8):
        loss = model.loss(ids, tgt, loops=1 + step % 3)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 3))
    with torch.no_grad():
        final = float(model.loss(ids, tgt, loops=3))
    assert final < start - 1.0, f"{name}: loss {start:.3f} → {final:.3f} ({losses})"


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_round_trip(name, tmp_path):
    model = _tiny(name)
    with torch.no_grad():  # move every weight off its init so a fresh build would not match
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.eval()
    ids, _ = _batch(3)
    path = save_checkpoint(tmp_path / "ck", model, RunConfig(model=model.config))
    loaded, cfg, _ = load_checkpoint(path)
    assert cfg.model.recurrence == name
    with torch.no_grad():
        for loops in (1, 3):
            assert torch.equal(model(ids, loops=loops), loaded(ids, loops=loops))


@pytest.mark.parametrize(
    "name, settings",
    [
        ("hyper_scse", {"lanes": 2}),
        ("hyper_looped", {"lanes": 3}),
        ("step_film", {"step_embedding": "sinusoidal", "film_scale": 0.5}),
        ("norm_reset", {"period": 2}),
        ("capacity_matched", {"w_in": True}),
        ("forcing_subtraction", {"step_tau": 0.015}),
        ("scse_leak", {"leak": 0.05}),
    ],
)
def test_settings_survive_a_checkpoint(name, settings, tmp_path):
    model = _tiny(name, **settings).eval()
    ids, _ = _batch(4)
    path = save_checkpoint(tmp_path / "ck", model, RunConfig(model=model.config))
    loaded, cfg, _ = load_checkpoint(path)
    assert cfg.model.recurrence_args == settings
    with torch.no_grad():
        assert torch.equal(model(ids, loops=5), loaded(ids, loops=5))


@pytest.mark.parametrize(
    "name, settings",
    [
        ("norm_reset", {"period": 0}),
        ("hyper_scse", {"lanes": 0}),
        ("hyper_scse", {"anchor": "nope"}),
        ("step_film", {"step_embedding": "learned"}),
        ("step_film", {"n_steps": 0}),
        ("scse_leak", {"leak": 1.5}),
        ("gated", {"gate": 1.0}),
    ],
)
def test_bad_settings_raise_clear_errors(name, settings):
    with pytest.raises(LoopLMError, match=next(iter(settings))):
        build_model("tiny", name, **settings)


# ----------------------------------------------------------------------------- anchor ablations


@pytest.mark.parametrize("anchor", ["learned", "embedding", "init", "frozen_random"])
def test_anchor_ablations_keep_the_anchor_a_fixed_point(anchor):
    model = _tiny("scse", anchor=anchor).eval()
    ids, _ = _batch(6)
    with torch.no_grad():
        ctx = model.prepare(ids)
        assert torch.equal(model.step(ctx.anchor, ctx, 0), ctx.anchor)
        if anchor == "embedding":
            assert torch.equal(ctx.anchor, ctx.e)


def test_frozen_random_anchor_is_not_trained():
    """The frozen projection is left out of the trainer's optimizer and never changes."""
    train = pytest.importorskip("looplm.training.loop", reason="trainer module not present")
    model = _tiny("scse", anchor="frozen_random")
    frozen = model.recurrence.anchors.anchor_proj.weight
    assert not frozen.requires_grad
    before = frozen.detach().clone()
    others = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    cfg = RunConfig(model=model.config)
    cfg.train.lr = 3e-3
    opt = train.make_optimizer(model, cfg, torch.device("cpu"))
    in_opt = {id(p) for group in opt.param_groups for p in group["params"]}
    assert id(frozen) not in in_opt
    ids, tgt = _batch(7)
    for _ in range(3):
        loss = model.loss(ids, tgt, loops=3)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.equal(frozen, before)
    moved = [
        n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, others[n])
    ]
    assert "recurrence.anchors.init_delta_proj.weight" in moved and "block.attn.qkv.weight" in moved


@pytest.mark.parametrize(
    "name, gains",
    [
        ("capacity_matched", ["alpha"]),
        ("step_conditioned", ["alpha"]),
        ("sc_cond", ["kappa"]),
        ("scse_leak", ["kappa"]),
        ("forcing_subtraction", ["alpha"]),
        ("gated", ["layerscale", "gate_bias"]),
        ("norm_reset", ["reset_gain"]),
        ("hyper_scse", ["hc_read", "hc_mix", "hc_write"]),
    ],
)
def test_gains_are_exempt_from_weight_decay(name, gains):
    train = pytest.importorskip("looplm.training.loop", reason="trainer module not present")
    model = _tiny(name)
    declared = {id(p) for p in model.recurrence.no_decay_parameters()}
    assert declared == {id(getattr(model.recurrence, g)) for g in gains}
    opt = train.make_optimizer(model, RunConfig(model=model.config), torch.device("cpu"))
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not decayed & declared  # hc_mix is 2-D: only the declaration keeps it undecayed


# ----------------------------------------------------------------------------- CLI


def _cli(argv: list[str]) -> int:
    from looplm.commands import methods

    parser = argparse.ArgumentParser()
    methods.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def test_methods_command_is_registered():
    from looplm.cli import COMMAND_MODULES

    assert "looplm.commands.methods" in COMMAND_MODULES


def test_methods_command_lists_every_method(capsys):
    assert _cli(["methods", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {(r["name"], r["preset"]): r for r in rows}
    assert {r["name"] for r in rows if "settings" not in r} == set(NAMES)
    alpha = by_name[("looped learn_gain=true injection_gain=0.15", "22m")]
    assert alpha["recurrence"] == "looped" and alpha["settings"] == {
        "learn_gain": True,
        "injection_gain": 0.15,
    }
    assert alpha["params"] == by_name[("looped", "22m")]["params"] + 1  # the learned α
    assert by_name[("forcing_subtraction", "22m")]["c_body"] == 2
    assert by_name[("scse", "22m")]["zero_forcing_bias"] is True
    assert by_name[("unshared", "22m-unshared-4x320")]["params"] == 22_679_680
    assert _cli(["methods", "--preset", "tiny"]) == 0
    text = capsys.readouterr().out
    for name in NAMES:
        assert name in text


def test_methods_command_rejects_unknown_preset():
    with pytest.raises(LoopLMError, match="preset"):
        _cli(["methods", "--preset", "7b"])


@pytest.mark.parametrize("name", [n for n in NAMES if n != UNSHARED])
def test_uses_all_parameters_flag_is_truthful(name):
    """DDP skips its unused-parameter search when a recurrence declares it uses every parameter."""
    from looplm.model.recurrences import get_recurrence_class

    declared = get_recurrence_class(name).uses_all_parameters
    x = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(0))
    all_used = True
    for T in (1, 2, 3):
        torch.manual_seed(0)
        m = looplm.build_model("tiny", name, dropout=0.0)
        m.loss(x, x, loops=T).backward()
        all_used &= all(p.grad is not None for p in m.parameters() if p.requires_grad)
    if declared:
        assert all_used
    else:
        assert not all_used  # the flag is only set where parameters really sit out
