"""The compiled read paths (``eval --compile``): the fixed-depth sweep's full batches through one
fullgraph graph (one unroll, every depth's sums stacked), compiled once per sweep, ≡ the eager
sweep; the last partial batch eager. Per-token halting stays eager (its active rows are a
data-dependent shape) with one host read per loop step, its results unchanged.

Graphs are traced with the ``aot_eager`` backend or counted with a ``CompileCounter`` (no C++
build); the slow run also compiles with inductor. Tolerance, compiled vs eager, fp32 model, float64 sums: 1e-5 relative on Σ NLL (the compiled
readout reads every row with unscored targets weighted 0, the eager one the scored rows through
the chunked loss — the same sums in another order); token and hit counts exactly equal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounter

from looplm.adaptive.halting import LinearRouter
from looplm.data.sources import eval_windows
from looplm.errors import LoopLMError
from looplm.evaluate.settings import EvalSettings
from looplm.evaluate.sweep import CompiledSweep, depth_sweep
from looplm.model import model_from_config
from looplm.settings.config import load_config
from looplm.targets import IGNORE_INDEX

TINY = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "model.context=16"]
DEPTHS = [3, 1, 2]


@pytest.fixture(autouse=True)
def _fresh_compiler():
    torch._dynamo.reset()  # every test counts its own compilations
    yield
    torch._dynamo.reset()


class _Corpus:
    """An LM source over random tokens: context windows, the last batch partial."""

    is_task = False

    def __init__(self, n_tokens: int, vocab: int, context: int) -> None:
        self.tokens = np.random.default_rng(0).integers(0, vocab, n_tokens)
        self.context = context

    def eval_batches(self, batch_size, max_tokens=None, n_examples=0):
        yield from eval_windows(self.tokens, batch_size, self.context, max_tokens)


def _model(*extra: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = load_config(None, ["model.recurrence=scse", "model.dropout=0.0", *TINY, *extra])
    return model_from_config(cfg.model)


def _rows(model, source, **kw):
    return depth_sweep(model, source, DEPTHS, batch_size=4, **kw)


@pytest.mark.parametrize("extra", [[], ["model.n_layers=3", "model.recurrence=unshared"]])
def test_compiled_sweep_equals_eager_and_runs_the_partial_batch_eager(extra):
    model = _model(*extra)
    source = _Corpus(16 * 4 * 3 + 37, model.config.vocab_size, 16)  # 3 full batches + a partial
    eager = _rows(model, source)
    compiled = CompiledSweep(model, DEPTHS, (4, 16), backend="aot_eager")  # fullgraph: no breaks
    got = _rows(model, source, compile=compiled)
    assert compiled.compiled_batches == 3
    assert [r["depth"] for r in got] == [r["depth"] for r in eager] == [1, 2, 3]
    for g, e in zip(got, eager):
        assert g["n_tokens"] == e["n_tokens"] == 16 * 4 * 3 + 36
        assert g.keys() == e.keys()
        assert g["sum_nll"] == pytest.approx(e["sum_nll"], rel=1e-5)
        assert g["ppl"] == pytest.approx(e["ppl"], rel=1e-5)
    assert len({r["nll"] for r in got}) == 3  # the depths differ: not one depth thrice


def test_a_sweep_of_many_full_batches_compiles_once_and_counts_hits():
    model = _model()
    counter = CompileCounter()
    compiled = CompiledSweep(model, DEPTHS, (4, 16), backend=counter)
    source = _Corpus(16 * 4 * 6 + 1, model.config.vocab_size, 16)  # exactly 6 full batches
    rows = _rows(model, source, compile=compiled)
    assert counter.frame_count == 1 and compiled.compiled_batches == 6
    assert counter.op_count > 0
    eager = _rows(model, source)
    for g, e in zip(rows, eager):
        assert g["n_tokens"] == e["n_tokens"] == 16 * 4 * 6
        assert g["sum_nll"] == pytest.approx(e["sum_nll"], rel=1e-5)


@pytest.mark.slow
def test_inductor_compiled_sweep_equals_eager():
    """Inductor's own kernels (what ``eval --compile`` runs), on the tiniest model."""
    model = _model()
    source = _Corpus(16 * 4 * 2 + 9, model.config.vocab_size, 16)
    eager = _rows(model, source)
    got = _rows(model, source, compile=True)
    for g, e in zip(got, eager):
        assert g["n_tokens"] == e["n_tokens"]
        assert g["sum_nll"] == pytest.approx(e["sum_nll"], rel=1e-5)


def test_task_accuracy_is_the_same_compiled():
    """A task's hits are counted in the graph as eagerly (argmax over the whole vocabulary)."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
    y = torch.full_like(x, IGNORE_INDEX)
    y[:, 5] = torch.randint(0, model.config.vocab_size, (4,), generator=g)
    source = type("Task", (), {"is_task": True, "eval_batches": lambda self, *a: [(x, y)] * 2})()
    with torch.no_grad():
        y[:2, 5] = model(x, 3)[:2, 5].argmax(-1)  # two hits at depth 3
    eager = _rows(model, source)
    got = _rows(model, source, compile=CompiledSweep(model, DEPTHS, (4, 16), backend="aot_eager"))
    for a, b in zip(got, eager):
        assert a["accuracy"] == b["accuracy"] and a["n_examples"] == b["n_examples"] == 8
    assert got[-1]["accuracy"] >= 0.5


def test_bad_compiled_sweep_settings_are_one_line_errors():
    model = _model()
    source = _Corpus(40, model.config.vocab_size, 16)
    with pytest.raises(LoopLMError, match="compiled sweep is for depths"):
        _rows(model, source, compile=CompiledSweep(model, [1, 2], (4, 16), backend="eager"))
    with pytest.raises(LoopLMError, match="has no iter_depths"):
        CompiledSweep(torch.nn.Linear(2, 2), [1], (4, 16))
    s = EvalSettings(lambada="x.jsonl", compile=True)
    with pytest.raises(LoopLMError, match="--compile applies to the fixed-depth sweep"):
        s.validate()


def test_eval_command_threads_compile_to_the_sweep(tmp_path, monkeypatch):
    """``looplm eval --compile`` reaches ``depth_sweep`` (its graphs traced by Dynamo alone)."""
    import looplm.evaluate.sweep as sweep_mod
    from looplm.evaluate.checkpoint import evaluate_one
    from looplm.model.checkpoint import save_checkpoint

    monkeypatch.setattr(sweep_mod, "COMPILE_BACKEND", "eager")
    seen = []
    real = sweep_mod.CompiledSweep.__call__

    def spy(self, x, y):
        seen.append(tuple(x.shape))
        return real(self, x, y)

    monkeypatch.setattr(sweep_mod.CompiledSweep, "__call__", spy)
    cfg = load_config("tiny_bool", ["model.dropout=0.0", *TINY[:3], "eval.n_examples=8"])
    model = model_from_config(cfg.model)
    save_checkpoint(tmp_path / "ckpt", model, cfg, state={"step": 0})
    s = EvalSettings(depths=[1, 2], compile=True, batch_size=4)
    result, _, _ = evaluate_one(str(tmp_path / "ckpt"), s, progress=False)
    assert len(seen) == 2 and [r["depth"] for r in result["results"]] == [1, 2]
    plain, _, _ = evaluate_one(str(tmp_path / "ckpt"), EvalSettings(depths=[1, 2], batch_size=4))
    for a, b in zip(result["results"], plain["results"]):
        assert a["accuracy"] == b["accuracy"]
        assert a["sum_nll"] == pytest.approx(b["sum_nll"], rel=1e-5)


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's values on the host (a GPU sync): ``bool``/``int``/
    ``item``/``tolist``, ``nonzero`` and indexing by a boolean mask (its size is data)."""

    READS = {"__bool__", "__int__", "__float__", "item", "tolist", "nonzero", "masked_select"}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__", "index_put_") else ()
        index = index if isinstance(index, (tuple, list)) else (index,)
        if name in self.READS or any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index
        ):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("skip", [True, False])
def test_per_token_halting_reads_the_host_once_per_step_with_the_same_results(skip, monkeypatch):
    """Per-token halting stays eager (active rows are a data-dependent shape) but each step's
    decision reads the host once (the active tokens' indices), however many tokens halt."""
    import looplm.model.halting as halting_mod
    from looplm.adaptive.halting import per_token_halting
    from looplm.model.halting import TokenHalting
    from looplm.model.halting_rules import KLHalt

    model = _model().eval()
    with torch.no_grad():
        for p in model.block.parameters():  # random init barely moves h: sharpen the block
            if p.dim() == 2:
                p.mul_(4.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (8, 16), generator=g)
    want = per_token_halting(model, x, KLHalt(1e-3), 10, skip=skip)
    modes, real = [], TokenHalting.observe

    def observe(self, step, loops):
        with _HostReads() as mode:
            real(self, step, loops)
        modes.append((step.t < loops, self.n_active, mode.calls))

    monkeypatch.setattr(TokenHalting, "observe", observe)
    monkeypatch.setattr(halting_mod, "chunk_rows", lambda v: 16)  # several readout chunks too
    h, depth = per_token_halting(model, x, KLHalt(1e-3), 10, skip=skip)
    assert torch.equal(depth, want[1]) and torch.equal(h, want[0])
    assert 1 < depth.float().mean() < 10  # some tokens halted early, some later: partial steps
    partial = [c for asked, n, c in modes if asked and 0 < n < 8 * 16]
    assert partial, "no step ran with only some tokens active"
    assert all(c == ["nonzero"] for asked, _, c in modes if asked), modes


def test_router_harvest_reads_the_host_once_per_batch():
    """The router's training data gathers the scored tokens by indices taken once per batch (a
    boolean mask each step would read the host twice a step): as many host reads at ceiling 6
    as at 3 (on the CPU the embedding also checks the token ids, once per batch)."""
    from looplm.adaptive.halting import harvest_router_data

    model = _model().eval()
    g = torch.Generator().manual_seed(2)
    data = []
    for _ in range(2):
        x = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
        y = torch.randint(0, model.config.vocab_size, (4, 16), generator=g)
        y[0, 5:] = IGNORE_INDEX
        data.append((x, y))
    calls = {}
    for ceiling in (3, 6):
        with _HostReads() as mode:
            X, Y = harvest_router_data(model, data, ceiling)
        calls[ceiling] = mode.calls
    assert calls[6] == calls[3] and calls[6].count("nonzero") == 2  # none per loop step
    assert X.shape == (2 * (4 * 16 - 11) * 5, 32) and Y.shape == (X.shape[0],)
    h = model(data[0][0], 1, return_states=True).states[1]  # the first decision's features
    want = LinearRouter.features(h[data[0][1] != IGNORE_INDEX])
    torch.testing.assert_close(X[: want.shape[0]], want, rtol=0, atol=0)
