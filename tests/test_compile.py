"""The compiled training step (``train.compile``): one fullgraph graph per loop depth T for every
recurrence, the unshared control, prelude/core/coda models and the imported families; compiled ≡
eager; one compilation per T; resume of a compiled run ≡ an eager run; Eq. 4 exact under compile.

Most checks compile with the ``eager`` or ``aot_eager`` backend: Dynamo traces the whole loss with
``fullgraph=True`` (any graph break fails) and AOT autograd traces its backward, as with inductor,
without inductor's C++ build (slow on a CPU). Eq. 4's exactness runs inductor itself on the tiniest
model (the slow run also its backward).
Tolerance, compiled vs eager, fp32: 1e-5 relative + 1e-6 absolute on the summed loss, 1e-4 + 1e-5
on every gradient (entries of order 1e-2 … 1: the compiled loss reads every row with unscored
targets weighted 0 and a plain cross-entropy, the eager one the scored rows through the chunked
loss — the same sums in another order).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

import looplm.training.compiled_step as compiled_mod
from looplm.model import model_from_config
from looplm.model.checkpoint import load_checkpoint
from looplm.model.families import published_model_config
from looplm.model.recurrences import recurrence_names
from looplm.settings.config import load_config
from looplm.targets import IGNORE_INDEX
from looplm.training.compiled_step import CompiledLoss
from looplm.training.loop import fit

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pretrained"
TINY = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.context=16"]
PUBLISHED = {
    "parcae": "parcae-small-140m.json",
    "huginn": "huginn-0125.json",
    "ouro": "1.4B.json",
    "hrm_text": "HRM-Text-1B.json",
}
KWARGS = dict(objective="final", truncate_k=0, checkpoint_loops=False)


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()  # every test counts its own compilations
    yield
    torch._dynamo.reset()


def _model(name: str) -> torch.nn.Module:
    """A tiny fp32 model, dropout 0: a registered recurrence, the unshared control, a
    prelude/core/coda model, or a published family's architecture shrunk to width 32."""
    torch.manual_seed(0)
    if name.startswith("family:"):
        fam = name.split(":")[1]
        raw = json.loads((FIXTURES / fam / "published" / PUBLISHED[fam]).read_text())
        raw = raw.get("config", raw)
        raw = {k: v for k, v in raw.items() if not k.startswith("_") or k == "_class_name"}
        _, mc = published_model_config(raw)
        kv = mc.n_kv_heads and 1  # grouped-query attention kept where the family has it
        mc = dataclasses.replace(
            mc, d_model=32, n_heads=2, n_kv_heads=kv, d_ff=64, vocab_size=97, context=16
        )
        mc = dataclasses.replace(mc, core_layers=2) if mc.core_layers > 2 else mc
        mc.validate()
        return model_from_config(mc)
    extra = {
        "unshared": ["model.n_layers=2"],
        "prelude_core_coda": [
            "model.positions=rope",
            "model.prelude_layers=1",
            "model.core_layers=2",
            "model.coda_layers=1",
        ],
    }.get(name, [])
    rec = "scse" if name == "prelude_core_coda" else name
    cfg = load_config(None, [f"model.recurrence={rec}", "model.dropout=0.0", *TINY, *extra])
    return model_from_config(cfg.model)


CASES = [*recurrence_names(), "prelude_core_coda", *(f"family:{f}" for f in PUBLISHED)]


def _batch(model, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    V, L = model.config.vocab_size, model.config.context
    x = torch.randint(0, V, (2, L), generator=g)
    y = torch.randint(0, V, (2, L), generator=g)
    y[0, :3] = IGNORE_INDEX  # unscored targets: weighted 0 in the compiled loss
    return x, y


def _loss_and_grads(fn, model, x, y, loops):
    model.zero_grad(set_to_none=True)
    loss = fn(x, y, loops=loops, **KWARGS)
    loss.backward()
    return loss.detach(), {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _close(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _close_grad(a, b) -> None:
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# The default run: every registered recurrence, the unshared control and one family traced whole
# by Dynamo with fullgraph=True, a break being an error; compiled ≡ eager with gradients through
# AOT autograd for two. The slow run traces the other families and the prelude/core/coda model
# (~30 s), repeats the gradient check for every case (~4 min on a CPU) and runs inductor's backward.
FAST_GRADS = ["scse", "unshared"]
FAST_TRACE = [*recurrence_names(), "family:ouro"]


def _check_trace(names: list[str]) -> None:
    for name in names:
        torch._dynamo.reset()
        model = _model(name)
        x, y = _batch(model)
        with torch.no_grad():
            got = CompiledLoss(model, 1, backend="eager")(x, y, loops=1, **KWARGS)
            _close(got, model.loss(x, y, 1, reduction="sum"))


def test_every_recurrence_traces_as_one_graph():
    _check_trace(FAST_TRACE)


@pytest.mark.slow
def test_every_family_and_prelude_coda_model_traces_as_one_graph():
    _check_trace([c for c in CASES if c not in FAST_TRACE])


def _check_grads(name: str) -> None:
    model = _model(name)
    model.train()
    x, y = _batch(model)
    loops = 1 if name == "unshared" else 2
    eager = lambda a, b, **kw: model.loss(a, b, reduction="sum", **kw)  # noqa: E731
    want_loss, want = _loss_and_grads(eager, model, x, y, loops)
    compiled = CompiledLoss(model, 1, backend="aot_eager")  # fullgraph: a break raises
    got_loss, got = _loss_and_grads(compiled, model, x, y, loops)
    _close(got_loss, want_loss)
    assert got.keys() == want.keys()
    for k in want:
        _close_grad(got[k], want[k])


@pytest.mark.parametrize("name", FAST_GRADS)
def test_fullgraph_compiled_loss_and_gradients_equal_eager(name):
    _check_grads(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", [c for c in CASES if c not in FAST_GRADS])
def test_fullgraph_compiled_loss_and_gradients_equal_eager_every_case(name):
    _check_grads(name)


@torch.no_grad()
def test_one_compilation_per_depth_reused_for_every_later_draw():
    model = _model("scse")
    counter = CompileCounter()
    compiled = CompiledLoss(model, 3, backend=counter)
    x, y = _batch(model)
    draws = [2, 1, 2, 3, 1, 1, 3, 2]
    for t in draws:
        compiled(x, y, loops=t, **KWARGS)
    assert counter.frame_count == len(set(draws)) == 3  # one graph per T, none recompiled
    assert compiled.depths == set(draws)


@pytest.mark.slow
def test_inductor_compiled_loss_and_gradients_equal_eager():
    """Inductor's own kernels (not just tracing), on the tiniest model."""
    model = _model("scse")
    x, y = _batch(model)
    eager = lambda a, b, **kw: model.loss(a, b, reduction="sum", **kw)  # noqa: E731
    compiled = CompiledLoss(model, 1)
    want_loss, want = _loss_and_grads(eager, model, x, y, 1)
    for _ in range(2):  # the second call reuses the graph
        got_loss, got = _loss_and_grads(compiled, model, x, y, 1)
        _close(got_loss, want_loss)
        for k in want:
            _close_grad(got[k], want[k])


@torch.no_grad()
def test_scse_mask_is_exact_under_inductor():
    """Eq. 4 under compile: a zero Δ and a Δ below ε stay bit for bit (b_t = 0), a larger one
    moves; the compiled step equals the eager one."""
    model = _model("scse").eval()
    x, _ = _batch(model)
    ctx = model.prepare(x[:1].expand(3, -1))
    d = torch.zeros(3, *ctx.anchor.shape[1:])
    d[1] = 1e-6 * torch.randn_like(d[1])  # ‖Δ‖² ≈ 5e-10 < ε = 1e-8
    d[2] = torch.randn_like(d[2])
    rec = model.recurrence

    def step(state):
        return rec.step(model.core_call(ctx), state, ctx, 0)

    out = torch.compile(step, fullgraph=True)(d)
    assert torch.equal(out[0], d[0]) and torch.equal(out[1], d[1])  # b_t = 0, masked Δ unchanged
    assert not torch.equal(out[2], d[2])
    torch.testing.assert_close(out, step(d), rtol=1e-5, atol=1e-6)


def test_resume_of_a_compiled_run_equals_an_eager_run(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_mod, "COMPILE_BACKEND", "eager")  # Dynamo's graphs, no codegen
    over = [
        "train.steps=4",
        "train.batch_size=4",
        "train.warmup=1",
        "train.log_every=1",
        "train.depth_max=3",
        "eval.n_examples=8",
        "model.dropout=0.0",
        *TINY[:3],
    ]
    eager = load_config("tiny_bool", [*over, f"out_dir={tmp_path / 'eager'}"])
    fit(eager, progress=False, quiet=True)
    comp = load_config("tiny_bool", [*over, "train.compile=true", f"out_dir={tmp_path / 'c'}"])
    stopped = fit(comp, progress=False, quiet=True, callbacks=[lambda ts, m: ts.step == 2])
    assert stopped["stopped"] == "callback"
    fit(comp, resume=True, progress=False, quiet=True)
    a, _, meta_a = load_checkpoint(tmp_path / "eager" / "ckpt")
    b, _, meta_b = load_checkpoint(tmp_path / "c" / "ckpt")
    assert meta_a["state"]["step"] == meta_b["state"]["step"] == 4
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=n)


def test_bad_token_ids_are_refused_on_the_host_before_a_compiled_step(tmp_path):
    model = _model("scse")
    x, y = _batch(model)
    x[1, 2] = model.config.vocab_size
    with pytest.raises(Exception, match=f"token id {model.config.vocab_size} is outside"):
        model.loss(x, y, loops=1)  # eager: the embedding's one-line error
    from looplm.model.lm import check_token_ids

    with pytest.raises(Exception, match="is outside the vocabulary"):
        check_token_ids(x, model.config.vocab_size)  # what the training step runs on the host


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw",
    [
        dict(objective="per_step", truncate_k=0, checkpoint_loops=False),
        dict(objective="final", truncate_k=1, checkpoint_loops=False),
        dict(objective="final", truncate_k=0, checkpoint_loops=True),
    ],
)
def test_training_options_compile_whole_and_equal_eager(kw):
    model = _model("scse")
    x, y = _batch(model)
    model.zero_grad(set_to_none=True)
    want = model.loss(x, y, 3, reduction="sum", **kw)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = CompiledLoss(model, 1, backend="aot_eager")(x, y, loops=3, **kw)
    got.backward()
    _close(got.detach(), want.detach())
    for n, g in want_grads.items():
        _close_grad(dict(model.named_parameters())[n].grad, g)
