"""Analyses on imported checkpoints: each fixture imported with a small tokenizer of its own,
then evaluated over depths (beyond the trained count too), used for generation with per-token
halting over many prompts, and run through every analysis — KL halting, diagnostics, adaptive
depth, the Jacobian lens, export to transformers, lm-eval — each reading the model's own readout
(through Parcae's and Huginn's coda)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from pretrained_common import close, fixture, load, logits_at

from looplm.adaptive.halting import per_token_halting
from looplm.cli import main
from looplm.data import get_tokenizer
from looplm.diagnostics.runner import DiagnoseSettings, diagnose_model
from looplm.lens.jacobian import fit_jacobian_lens
from looplm.lens.layers import fit_layer_lens, layer_counts, virtual_layers
from looplm.model.halting_rules import KLHalt

TRAINED = {"parcae": 8, "huginn": 32, "ouro": 4}


def _tokenizer(path) -> None:
    """A character tokenizer (ids < 98, inside every fixture's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<|endoftext|>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "<unk>": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained_cli")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while loops read text".split()
    docs = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(9)]
    (root / "corpus.txt").write_text("\n\n".join(docs))
    (root / "prompts.txt").write_text("the quick brown\nloops read\n")
    out = {}
    for family in TRAINED:
        import shutil

        src = root / f"src_{family}"
        shutil.copytree(fixture(family), src)
        _tokenizer(src / "tokenizer.json")
        assert main(["import", str(src), str(root / family)]) == 0
        out[family] = root / family
    return root, out


@pytest.mark.parametrize("family", list(TRAINED))
def test_pretrained_eval_over_depths_beyond_the_trained_count(imported, family, capsys):
    root, ckpt = imported
    T = TRAINED[family]
    capsys.readouterr()
    args = ["eval", str(ckpt[family]), "--depths", f"1,{T + 1}", "--max-tokens", "48"]
    assert main([*args, "--dataset", f"text:{root / 'corpus.txt'}"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["depth"] for r in rows] == [1, T + 1]
    assert all(r["n_tokens"] == 48 and r["nll"] > 0 for r in rows)


@pytest.mark.parametrize("family", list(TRAINED))
def test_pretrained_generate_prompts_with_per_token_halting(imported, family, capsys):
    root, ckpt = imported
    rule = "gate" if family == "ouro" else "maxtoken"
    capsys.readouterr()
    code = main(["generate", str(ckpt[family]), "--prompts", str(root / "prompts.txt"),
                 "--max-new", "3", "--loops", "3", "--halt", rule, "--threshold", "0.5"])  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["index"] for x in lines] == [0, 1]
    assert all(x["new_tokens"] == 3 and 1 <= x["mean_loops"] <= 3 for x in lines)


def test_pretrained_generate_kl_halting_through_the_coda(imported, capsys):
    _, ckpt = imported
    code = main(["generate", str(ckpt["huginn"]), "--prompt", "the", "--max-new", "3",
                 "--halt", "kl", "--threshold", "0.01"])  # fmt: skip
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize(("family", "thr"), [("parcae", 0.1), ("huginn", 0.01)])
def test_pretrained_cached_kl_halting_is_the_per_token_evaluation(family, thr):
    """KL halting in cached generation on a model with coda layers reads every step through the
    coda with the earlier positions' step-t coda inputs (kept per step in the cache): with
    prefill halting, the prompt's and every generated token's depths and the tokens are those of
    the uncached per-token evaluation of the whole sequence; batched decoding halts as one by
    one; threshold 0 is fixed-depth generation."""
    from looplm.decoding.decoder import decode, generate

    model = load(family).double().eval()
    prompt = _ids(0, (2, 6))
    T, P = 4, prompt.shape[1]
    g = decode(model, prompt, 6, T, halt="kl", threshold=thr, prefill_halt=True)
    h, depth = per_token_halting(model, g.tokens[:, :-1], KLHalt(thr), T)
    assert len(depth.unique()) >= 2  # the rule acts
    assert torch.equal(g.prompt_loops, depth[:, :P])
    assert torch.equal(g.loops[:, 1:], depth[:, P:])
    assert torch.equal(model.readout(h[:, P - 1 :]).argmax(-1), g.tokens[:, P:])
    later = decode(model, prompt, 6, T, halt="kl", threshold=thr)  # prompt at full depth
    for b in range(2):
        one = decode(model, prompt[b : b + 1], 6, T, halt="kl", threshold=thr)
        assert torch.equal(one.tokens[0], later.tokens[b])
        assert torch.equal(one.loops[0], later.loops[b])
    zero = decode(model, prompt, 6, T, halt="kl", threshold=0.0)
    assert torch.equal(zero.tokens, generate(model, prompt, 6, loops=T))


# ------------------------------------------------------------------ every analysis, through the coda
FAMILIES = list(TRAINED)


def _ids(seed: int = 0, shape=(2, 12)) -> torch.Tensor:
    return torch.randint(1, 90, shape, generator=torch.Generator().manual_seed(seed))


def _log_probs(model, ids, loops) -> torch.Tensor:
    return torch.log_softmax(logits_at(model, ids, loops).double(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_kl_halting_reads_what_the_readout_reads(family):
    """Per-token KL halting decides on KL(p_t ‖ p_{t−1}) of the model's own readout (through
    Parcae's and Huginn's coda): with τ between the two middle values of KL(p_2 ‖ p_1) exactly
    the tokens below it stop at t = 2; τ = 0 runs every token to the ceiling and τ huge stops all
    at once — both read out as the fixed-depth model at that depth."""
    model = load(family).eval()
    x = _ids()
    lp1, lp2 = _log_probs(model, x, 1), _log_probs(model, x, 2)
    kl2 = (lp2.exp() * (lp2 - lp1)).sum(-1)  # (B, L)
    mid = kl2.flatten().sort().values[kl2.numel() // 2 - 1 : kl2.numel() // 2 + 1]
    _, depth = per_token_halting(model, x, KLHalt(float(mid.mean())), 3)
    assert torch.equal(depth == 2, kl2 < mid.mean())
    h, depth = per_token_halting(model, x, KLHalt(0.0), 3)
    assert (depth == 3).all()
    close(model.readout(h), logits_at(model, x, 3))
    h, depth = per_token_halting(model, x, KLHalt(1e9), 3)
    first = int(depth.min())
    assert int(depth.max()) == first < 3
    close(model.readout(h), logits_at(model, x, first))


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_diagnostics_read_through_the_coda(family):
    """The diagnostics' NLL at T and successive KL are the model's own readout at those depths."""
    model = load(family).double().eval()
    x, y = _ids(0), _ids(1)
    settings = DiagnoseSettings(loops=3, steer_inputs=0, check_steps=0)
    res, _ = diagnose_model(model, [(x, y)], settings, progress=False)
    nll = F.cross_entropy(logits_at(model, x, 3).flatten(0, 1), y.flatten()).item()
    assert res["summary"]["nll_T"] == pytest.approx(nll, rel=1e-9)
    lp = [_log_probs(model, x, t) for t in (1, 2, 3)]
    kl = [float((b.exp() * (b - a)).sum(-1).mean()) for a, b in zip(lp, lp[1:])]
    assert res["convergence"]["kl_per_loop"][1:] == pytest.approx(kl, rel=1e-9)


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_diagnose_command(imported, family, tmp_path, capsys):
    root, ckpt = imported
    args = ["diagnose", str(ckpt[family]), "--loops", "3", "--batches", "1", "--batch-size", "1",
            "--data", f"text:{root / 'corpus.txt'}", "--seq-len", "16", "--steer-inputs", "2",
            "--check-steps", "2", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    assert main(args) == 0
    row = json.loads((tmp_path / "summary.json").read_text())[family]
    assert row["n_scored_tokens"] == 16 and math.isfinite(row["nll_T"])
    assert row["lemma1_max_rel_error"] is not None and row["lemma1_max_rel_error"] < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_adaptive_depth_command(imported, family, tmp_path):
    """`looplm adaptive` on an imported model: the max-token rule, KL halting and the learned
    router (and Ouro's own exit gate) each give a row whose mean depth lies in 1 … C."""
    root, ckpt = imported
    rules = "maxtoken,kl,router" + (",gate" if family == "ouro" else "")
    args = ["adaptive", str(ckpt[family]), "--ceiling", "3", "--rules", rules, "--budgets", "2",
            "--kl-thresholds", "0.01", "--router-probs", "0.5", "--gate-thresholds", "0.5",
            "--dataset", f"text:{root / 'corpus.txt'}", "--split", "test",
            "--max-tokens", "24", "--batch-size", "2", "--out", str(tmp_path / "a.json")]  # fmt: skip
    assert main(args) == 0
    rows = json.loads((tmp_path / "a.json").read_text())["results"]
    modes = [r["mode"] for r in rows]
    assert modes[:3] == ["maxtoken:budget=2", "kl:thr=0.01", "router:p=0.5"]
    assert modes[3:] == (["gate:thr=0.5"] if family == "ouro" else [])
    assert all(1 <= r["mean_depth"] <= 3 and math.isfinite(r["nll"]) for r in rows)


def test_pretrained_gate_rule_on_a_model_without_a_gate_is_one_line(imported, capsys):
    root, ckpt = imported
    args = ["adaptive", str(ckpt["parcae"]), "--ceiling", "2", "--rules", "gate",
            "--dataset", f"text:{root / 'corpus.txt'}", "--split", "test", "--max-tokens", "8"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "gate" in err and "\n" not in err


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_lens_command(imported, family, tmp_path, capsys):
    """The Jacobian lens of an imported model (fit through the coda), its tuned-lens baseline
    and a dose-response."""
    root, ckpt = imported
    args = ["lens", str(ckpt[family]), "--out", str(tmp_path), "--data", f"text:{root / 'corpus.txt'}",
            "--seq-len", "16", "--prompts", "2", "--eval-prompts", "2", "--batch-size", "2",
            "--loops", "2", "--extrapolate", "3", "--strengths", "0,1", "--tuned-steps", "2",
            "--n-boot", "10", "--k", "2", "--no-plots"]  # fmt: skip
    assert main(args) == 0
    result = json.loads((tmp_path / "lens.json").read_text())
    assert (tmp_path / "lens_T2").is_dir() and (tmp_path / "lens_T3").is_dir()
    assert result["family"] == family and result["loops"] == 2
    for T in (2, 3):  # KL of the lens at t = 0 … T, one value per step
        kl = [v["mean"] for v in result["fidelity"][str(T)]["arms"]["jacobian"]["kl"]]
        assert len(kl) == T + 1 and all(math.isfinite(v) and v >= 0 for v in kl)


def test_pretrained_lens_token_directions_use_the_untied_head():
    """Ouro reads out through its own head (untied) with no final norm: at t = T the lens's token
    directions applied to a state are the logits of those tokens."""
    model = load("ouro").double().eval()
    x = _ids(2, (1, 10))
    lens = fit_jacobian_lens(model, [(x, x)], 2)
    h = torch.randn(5, model.config.d_model, dtype=torch.float64)
    ids = [3, 17, 42]
    close(h @ lens.token_directions(model, 2, ids).T, model.readout(h)[:, ids])


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_export_loads_in_transformers_with_the_same_logits(imported, family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, ckpt = imported
    model = load(family).eval()
    ids = _ids(3, (1, 8))
    for standalone in (False, True):
        out = tmp_path / f"export_{standalone}"
        args = ["export", str(ckpt[family]), str(out), "--loops", "3"]
        assert main(args + (["--standalone"] if standalone else [])) == 0
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
        with torch.no_grad():
            close(hf(ids).logits, logits_at(model, ids, 3))
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tok("the fox").input_ids == get_tokenizer(str(ckpt[family] / "tokenizer.json")).encode(
        "the fox"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_pretrained_lm_eval_log_likelihoods_are_looplm_nll(imported, family, tmp_path):
    """lm-evaluation-harness on an imported model (offline LAMBADA-format task on a small file):
    its log-likelihoods are looplm's completion NLL at the same depth."""
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install '.[test]')")
    from looplm.data.corpora import lambada_examples
    from looplm.decoding.lmeval import LAMBADA_TASK, evaluate_lambada_local
    from looplm.lambada.completion import lambada_items, lambada_sweep
    from looplm.model.checkpoint import load_checkpoint

    _, ckpt = imported
    texts = ["the quick brown fox jumps over the lazy dog", "loops read text while a dog jumps"]
    data = tmp_path / "lambada_test.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = evaluate_lambada_local(ckpt[family], data, loops=2, task_dir=tmp_path / "tasks")
    samples = sorted(out["samples"][LAMBADA_TASK], key=lambda s: s["doc_id"])
    model, cfg = load_checkpoint(ckpt[family])[:2]
    tok = get_tokenizer(cfg.model.tokenizer)
    items = lambada_items(lambada_examples(data), tok, cfg.model.context)
    assert len(samples) == len(items) == 2
    for s, item in zip(samples, items):
        ((ll, _greedy),) = s["resps"][0]
        (row,) = lambada_sweep(model.eval(), [item], [2])
        assert -ll == pytest.approx(row["sum_nll"], rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("family", ["parcae", "huginn", "ouro"])
def test_pretrained_lens_per_layer_is_the_jacobian_of_the_readout_state(family):
    """J_v of the per-layer lens equals finite differences over the whole virtual stack (prelude,
    core layers of every loop step, coda): the stream entering layer application v nudged by
    ε·e_j at one source position (added to what application v − 1 of the same segment adds to
    the stream last: its MLP's output, or its last norm's for sandwich and post norms), the change of finish(h_T) summed over that and later positions,
    averaged over the source positions. For Ouro, whose core reads the loop state itself, the
    lens entering layer 0 of step t is the per-step lens of step t − 1."""
    model = load(family).double().eval()
    x = _ids(4, (1, 4))
    T, eps = 2, 1e-6
    lens = fit_layer_lens(model, [x], T)
    p, k, c = layer_counts(model)
    assert (p, k, c) == {"parcae": (2, 2, 2), "huginn": (2, 4, 2), "ouro": (0, 3, 0)}[family]
    assert lens.meta["depth"] == T and lens.loops == p + T * k + c - 1
    applied = [m for m in virtual_layers(model)[0]]
    applied += [m for _ in range(T) for m in virtual_layers(model)[1]]
    applied += [m for m in virtual_layers(model)[2]]

    def final(call=None, pos=0, j=0):
        calls = []

        def nudge(_m, _args, out):
            calls.append(1)
            if len(calls) - 1 != call:
                return None
            out = out.clone()
            out[0, pos, j] += eps
            return out

        # the module whose output the layer adds to (or, post-norm, makes) the stream last
        last = {m: m.mlp if m.norm_placement == "pre" else m.norm4 for m in applied}
        hooks = [last[m].register_forward_hook(nudge) for m in set(applied)]
        try:
            with torch.no_grad():
                ctx = model.prepare(x)
                for last in model.unroll(ctx, T):  # noqa: B007
                    pass
                return model.finish(last.hidden, ctx)[0]  # (L, d)
        finally:
            for h in hooks:
                h.remove()

    base = final()
    # layer applications whose predecessor is the previous layer of the same segment
    inside = [p + i for i in (1, k - 1) if 0 < i < k] + [p + k + 1, p + T * k - 1]
    inside += [1] if p > 1 else []
    inside += [p + T * k + 1] if c > 1 else []
    for v in sorted(set(inside)):
        J = torch.zeros_like(lens.jacobians[v])
        for j in range(J.shape[1]):
            for q in range(x.shape[1]):
                J[:, j] += (final(v - 1, q, j) - base)[q:].sum(0) / eps
        close(lens.jacobians[v], J / x.shape[1], tol=1e-4)
    if family == "ouro":
        per_step = fit_jacobian_lens(model, [x], T)
        for t in range(1, T + 1):
            close(lens.jacobians[(t - 1) * k], per_step.jacobians[t - 1], tol=1e-9)


def test_pretrained_lens_command_per_core_layer(imported, tmp_path):
    root, ckpt = imported
    args = ["lens", str(ckpt["huginn"]), "--out", str(tmp_path), "--data", f"text:{root / 'corpus.txt'}",
            "--seq-len", "16", "--prompts", "2", "--eval-prompts", "2", "--batch-size", "2",
            "--loops", "2", "--extrapolate", "", "--interventions", "", "--tuned-steps", "0",
            "--n-boot", "10", "--layers"]  # fmt: skip
    assert main(args) == 0
    lay = json.loads((tmp_path / "lens.json").read_text())["layers"]
    assert (lay["prelude_layers"], lay["core_layers"], lay["coda_layers"]) == (2, 4, 2)
    assert len(lay["arms"]["jacobian"]["kl"]) == 2 + 2 * 4 + 2
    assert set(lay["arms"]) == {"jacobian", "logit"}
    assert (tmp_path / "lens_layers_T2" / "lens.json").is_file()
    assert (tmp_path / "lens_layers.png").is_file()


def test_pretrained_serve_halts_by_ouros_gate_and_by_kl_through_the_coda(imported):
    """`looplm serve` on imported checkpoints: halt=gate (Ouro's exit gate) and halt=kl on a
    model with coda layers (Huginn) give each token the depth `looplm generate` gives it (alone,
    greedy); a model without a gate, or a gate threshold above 1, is a 400 naming what is
    allowed."""
    import threading
    import urllib.error
    import urllib.request

    from looplm.decoding.decoder import decode
    from looplm.decoding.serve.app import Server, load_state
    from looplm.decoding.serve.settings import ServeSettings

    _, ckpt = imported

    def post(base, body):
        req = urllib.request.Request(
            base + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    cases = [("ouro", {"halt": "gate", "threshold": 0.5}, 200),
             ("ouro", {"halt": "gate", "threshold": 1.5}, 400),
             ("parcae", {"halt": "gate", "threshold": 0.5}, 400),
             ("huginn", {"halt": "kl", "threshold": 0.01}, 200)]  # fmt: skip
    for family, body, code in cases:
        settings = ServeSettings(checkpoint=str(ckpt[family]), host="127.0.0.1", port=0, slots=2,
                                 loops=3, model_name=family)  # fmt: skip
        state = load_state(settings)
        server, ready, port = Server(state), threading.Event(), []
        thread = threading.Thread(
            target=server.run,
            kwargs={"on_ready": lambda p, port=port, ready=ready: (port.append(p), ready.set())},
        )
        thread.start()
        try:
            assert ready.wait(30)
            prompt = "the quick"
            status, out = post(f"http://127.0.0.1:{port[0]}",
                               {"prompt": prompt, "max_tokens": 4, "temperature": 0, **body})  # fmt: skip
        finally:
            server.stop()
            thread.join(30)
        assert status == code, out
        if code != 200:
            msg = out["error"]["message"]
            assert "\n" not in msg and ("allowed" in msg or "threshold" in msg)
            continue
        got = out["choices"][0]["looplm"]
        ids = torch.tensor([state.tokenizer.encode(prompt)])
        ref = decode(state.model, ids, len(got["tokens"]), 3, **body)
        assert got["tokens"] == ref.tokens[0, ids.shape[1] :].tolist()
        assert got["loops"] == ref.loops[0].tolist() and min(got["loops"]) < 3  # the rule acts


@pytest.mark.parametrize("schedule", ["continuous", "static"])
def test_pretrained_batched_kl_halting_through_the_coda_is_decoding_alone(schedule):
    """Continuous batching with KL halting on a model with coda layers (rows of their own
    lengths, joining and leaving): every request's tokens and depths are those of decoding it
    alone."""
    from looplm.decoding.batching import Request, generate_many
    from looplm.decoding.decoder import decode

    model = load("huginn").eval()
    prompts = [_ids(s, (1, n))[0].tolist() for s, n in ((1, 5), (2, 9), (3, 3), (4, 7), (5, 4))]
    reqs = [Request(ids=tuple(p), max_new=m) for p, m in zip(prompts, (6, 3, 8, 5, 7))]
    out = generate_many(model, reqs, slots=2, loops=4, halt="kl", threshold=0.01,
                        schedule=schedule)  # fmt: skip
    depths = []
    for req, got in zip(reqs, out.completions):
        alone = decode(model, torch.tensor([req.ids]), req.max_new, 4, halt="kl", threshold=0.01)
        assert got.tokens == alone.tokens[0, len(req.ids) :].tolist()
        assert got.loops == alone.loops[0].tolist()
        depths += got.loops
    assert len(set(depths)) >= 2  # the rule acts
