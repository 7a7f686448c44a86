"""Structural model settings: adjacency-masked attention (one hop per loop step), rotary positions
(translation invariance), no positions, and the prelude–core–coda layout (k-layer core as one
update with G(0) = 0, exact counts, a 0/1/0 model equal to the plain one)."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

import looplm
from looplm.data.synthetic import graph_nodes_example, make_batch
from looplm.errors import LoopLMError
from looplm.model.block import rope
from looplm.model.masks import adjacency_mask


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bfs(edges: list[tuple[str, str]], src: str) -> dict[str, int]:
    """Hop distance from src along directed edges (an independent solver)."""
    dist, todo = {src: 0}, deque([src])
    while todo:
        u = todo.popleft()
        for a, b in edges:
            if a == u and b not in dist:
                dist[b] = dist[u] + 1
                todo.append(b)
    return dist


def _parse(text: str) -> tuple[list[tuple[str, str]], str, str]:
    head, nodes = text.split("|")
    edges = [(e[0], e[1]) for e in head.split(";")]
    src = next(c for c in nodes if c.isupper()).lower()
    return edges, src, nodes


@pytest.mark.parametrize("depth", [1, 2, 5, 8, 12])
def test_graph_nodes_labels_distances_and_balance(depth: int) -> None:
    rng = random.Random(depth)
    for _ in range(100):
        ex = graph_nodes_example(rng, depth)
        edges, src, nodes = _parse(ex.text)
        dist = _bfs(edges, src)
        start = ex.text.index("|") + 1
        assert len(set(nodes.lower())) == len(nodes)
        assert max(dist.values()) == depth  # the difficulty is the deepest hop count
        labels = list(ex.answers.values())
        assert labels.count("Y") == labels.count("N") > 0
        for i, a in ex.answers.items():
            v = ex.text[i]
            assert i >= start and v.islower()
            assert (a == "Y") == (v in dist), ex.text
            assert ex.distance[i] == dist.get(v, -1)


def test_adjacency_mask_is_self_plus_in_neighbours() -> None:
    b = make_batch("graph_nodes", 6, (1, 6), seed=3)
    m = adjacency_mask(b.input_ids)
    for r in range(6):
        ids = b.input_ids[r].tolist()
        text = bytes(c for c in ids if c < 256).decode()
        edges, _, nodes = _parse(text)
        start = text.index("|") + 1
        pos = {c.lower(): start + j for j, c in enumerate(nodes)}
        want = torch.eye(len(ids), dtype=torch.bool)
        for u, v in edges:
            want[pos[v], pos[u]] = True
        assert torch.equal(m[r], want)


@pytest.mark.parametrize("name", ["looped", "scse", "gated", "tuned_adapter"])
def test_adjacency_attention_moves_information_one_hop_per_loop_step(name: str) -> None:
    """Change only the source token's embedding (upper vs lower case names the same node): after
    t loops exactly the nodes within t hops of the source have changed states."""
    torch.manual_seed(0)
    model = looplm.build_model(
        "tiny", name, d_model=32, n_heads=2, d_ff=64, dropout=0.0, attention="adjacency",
        positions="none",
    ).double().eval()  # fmt: skip
    text = "ab;bc;cd;de;xy;yz;zc|edcBazyx"  # the source is b: c 1 hop, d 2, e 3; a, x, y, z never
    edges, src, nodes = _parse(text)
    dist = _bfs(edges, src)
    start = text.index("|") + 1
    ids = torch.tensor([list(text.encode())])
    alt = ids.clone()
    alt[0, start + nodes.index("B")] = ord("b")
    a_states = model(ids, loops=4, return_states=True).states
    b_states = model(alt, loops=4, return_states=True).states
    for t in range(5):
        changed = (a_states[t] - b_states[t]).abs().amax(-1)[0] > 0  # (L,), exact
        for j, c in enumerate(nodes):
            if c.lower() == src:
                continue
            assert bool(changed[start + j]) == (dist.get(c.lower(), 99) <= t), (t, c)
        assert not changed[:start].any()  # the edge list never hears of the source


def test_adjacency_attention_refuses_a_kv_cache() -> None:
    from looplm.decoding.decoder import generate

    model = looplm.build_model("tiny", "looped", attention="adjacency").eval()
    ids = torch.tensor([list(b"ab|Ab")])
    with pytest.raises(LoopLMError, match="KV cache cannot serve a data-given attention mask"):
        generate(model, ids, 2, loops=2)


def test_rope_scores_depend_on_relative_position_only() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 10, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 3, 10, 16, generator=g, dtype=torch.float64)
    pos = torch.arange(10)

    def scores(shift: int) -> torch.Tensor:
        return rope(q, pos + shift, 10000.0) @ rope(k, pos + shift, 10000.0).transpose(-1, -2)

    base = scores(0)
    for shift in (1, 7, 1000):
        torch.testing.assert_close(scores(shift), base, atol=1e-9, rtol=1e-9)
    assert not torch.allclose(base, q @ k.transpose(-1, -2))  # positions do enter
    # per-example positions (the active-row path) agree with shared positions
    per_ex = rope(q, (pos + 3).expand(2, 10), 10000.0)
    torch.testing.assert_close(per_ex, rope(q, pos + 3, 10000.0))


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_a_shifted_window_gets_the_same_attention_scores_with_rope_only(
    positions: str, monkeypatch
) -> None:
    """The model's own first-layer attention: the scores among a window's tokens are the same
    whether the window starts at position 0 or after 7 other tokens — with rotary positions;
    with learned absolute positions they change (so the test can tell the two apart)."""
    import looplm.model.block as block

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    sdpa = block.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q, k))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(block.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = looplm.build_model("tiny", "looped", positions=positions, dropout=0.0).double().eval()
    g = torch.Generator().manual_seed(2)
    window = torch.randint(0, 256, (2, 10), generator=g)
    prefix = torch.randint(0, 256, (2, 7), generator=g)
    with torch.no_grad():
        model(window, loops=1)
        model(torch.cat([prefix, window], dim=1), loops=1)
    (q0, k0), (q1, k1) = seen[0], seen[1]  # first layer of each forward
    at_zero = q0 @ k0.transpose(-1, -2)
    shifted = q1[:, :, 7:] @ k1[:, :, 7:].transpose(-1, -2)
    if positions == "rope":
        torch.testing.assert_close(shifted, at_zero, atol=1e-10, rtol=1e-10)
    else:
        assert not torch.allclose(shifted, at_zero, atol=1e-3)


def test_adjacency_attention_needs_a_node_task() -> None:
    from looplm.settings.config import load_config

    with pytest.raises(
        LoopLMError, match="model.attention=adjacency .* not data.dataset='bool_logic'"
    ):
        load_config("tiny_bool", ["model.attention=adjacency", "model.positions=none"])
    cfg = load_config("tiny_bool", ["model.attention=adjacency", "data.dataset=graph_nodes"])
    assert cfg.model.attention == "adjacency"


def test_rope_kv_cache_continues_positions() -> None:
    """With rotary positions and no learned positions, a sequence scored after a cached prefix of
    its own tokens gives the same new-token logits as the plain forward (positions continue)."""
    from looplm.decoding.decoder import next_logits
    from looplm.model.block import KVCache

    torch.manual_seed(0)
    model = looplm.build_model("tiny", "scse", positions="rope", dropout=0.0).double().eval()
    assert model.pos_emb is None
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
    full = model(ids, loops=3)[:, -1]
    cache = KVCache()
    next_logits(model, ids[:, :-1], 3, cache)
    torch.testing.assert_close(next_logits(model, ids[:, -1:], 3, cache), full)


def test_positions_none_and_rope_drop_the_position_table() -> None:
    n = {p: looplm.build_model("tiny", "scse", positions=p).num_parameters() for p in
         ("learned", "rope", "none")}  # fmt: skip
    cfg = looplm.build_model("tiny", "scse").config
    assert n["learned"] - n["rope"] == cfg.context * cfg.d_model
    assert n["rope"] == n["none"]
    with pytest.raises(LoopLMError, match="model.positions='alibi'; allowed: learned, rope, none"):
        looplm.build_model("tiny", "scse", positions="alibi")


# ----------------------------------------------------------------------------- prelude/core/coda
def _block_params(d: int, ff: int) -> int:
    return 2 * d + 4 * d * d + 3 * d * ff  # two RMSNorm gains, qkv + out, SwiGLU


@pytest.mark.parametrize("p, k, c", [(0, 1, 0), (1, 2, 1), (2, 3, 0), (0, 4, 2)])
def test_prelude_core_coda_parameter_counts(p: int, k: int, c: int) -> None:
    model = looplm.build_model(
        "tiny", "looped", prelude_layers=p, core_layers=k, coda_layers=c
    )  # fmt: skip
    cfg = model.config
    d, ff, V, L = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.context
    per = _block_params(d, ff)
    assert model.num_parameters() == V * d + L * d + d + (p + k + c) * per
    from looplm.model.accounting import parameter_count

    counts = parameter_count("tiny", "looped", prelude_layers=p, core_layers=k, coda_layers=c)
    assert counts["n_rec"] == k * per
    assert counts["n_once"] == V * d + L * d + d + (p + c) * per


def test_zero_one_zero_is_the_plain_model() -> None:
    torch.manual_seed(0)
    a = looplm.build_model("tiny", "scse")
    torch.manual_seed(0)
    b = looplm.build_model("tiny", "scse", prelude_layers=0, core_layers=1, coda_layers=0)
    assert list(a.state_dict()) == list(b.state_dict())
    assert all(torch.equal(a.state_dict()[n], b.state_dict()[n]) for n in a.state_dict())
    assert type(a.block).__name__ == "Block"


def test_k_layer_core_is_the_composition_of_its_layers_and_keeps_zero_bias() -> None:
    torch.manual_seed(0)
    model = looplm.build_model("tiny", "scse", core_layers=3, dropout=0.0).double().eval()
    x = torch.randn(2, 5, model.config.d_model, dtype=torch.float64)
    y = x
    for layer in model.block.layers:  # y_i = y_{i-1} + G_i(y_{i-1})
        y = y + layer(y)
    torch.testing.assert_close(model.block(x), y - x, atol=1e-12, rtol=0)
    z = torch.zeros_like(x)
    assert torch.equal(model.block(z), z)
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))
    out = model(ids, loops=3, return_states=True)
    for t in range(6):
        b = model.step(out.anchor, out.context, t) - out.anchor
        assert torch.equal(b, torch.zeros_like(b))


def test_prelude_and_coda_wrap_the_loop() -> None:
    torch.manual_seed(0)
    model = looplm.build_model(
        "tiny", "looped", prelude_layers=1, coda_layers=1, dropout=0.0
    ).double().eval()  # fmt: skip
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(0))
    e = model.embed(ids)
    e = e + model.prelude[0](e)
    h = e
    for _ in range(2):  # looped: h ← h + G(h + e), g = 1
        h = h + model.block(h + e)
    h = h + model.coda[0](h)
    torch.testing.assert_close(model(ids, loops=2), model.readout(h), atol=1e-10, rtol=0)


def test_prelude_core_coda_flops_count_every_layer() -> None:
    from looplm.model.accounting import flops

    base = flops("22m", "scse", 8)
    f = flops("22m", "scse", 8, prelude_layers=2, core_layers=3, coda_layers=1)
    assert f["n_body"] == 2 + 1 + 3 * 8
    assert f["body"] == f["n_body"] * base["per_body"]
    sub = flops("22m", "sc_cond_subtractive", 4, core_layers=2)
    assert sub["n_body"] == 2 * 2 * 4  # c_body = 2 calls of a 2-layer core per step


def test_bad_layouts_are_clear_errors() -> None:
    with pytest.raises(LoopLMError, match="model.core_layers=0 must be a positive integer"):
        looplm.build_model("tiny", "scse", core_layers=0)
    with pytest.raises(LoopLMError, match="model.coda_layers=-1 must be an integer >= 0"):
        looplm.build_model("tiny", "scse", coda_layers=-1)


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_kv_cache_serves_prelude_core_and_coda(positions: str) -> None:
    from looplm.decoding.decoder import generate, next_logits
    from looplm.model.block import KVCache

    torch.manual_seed(0)
    model = looplm.build_model(
        "tiny", "scse", prelude_layers=1, core_layers=2, coda_layers=1, positions=positions,
        dropout=0.0,
    ).double().eval()  # fmt: skip
    ids = torch.randint(0, 257, (2, 10), generator=torch.Generator().manual_seed(2))
    cache = KVCache()
    next_logits(model, ids[:, :6], 3, cache)
    for i in range(6, 10):
        torch.testing.assert_close(
            next_logits(model, ids[:, i : i + 1], 3, cache), model(ids[:, : i + 1], loops=3)[:, -1]
        )
    assert len(cache.slots) == 1 + 2 * 3 + 1  # prelude, core layers × loops, coda
    a = generate(model, ids[:, :4], 6, loops=3, use_cache=True)
    assert torch.equal(a, generate(model, ids[:, :4], 6, loops=3, use_cache=False))


def test_adaptive_depth_reads_through_the_coda_and_follows_the_mask() -> None:
    from looplm.adaptive.depth import maxtoken_forward
    from looplm.adaptive.halting import per_token_halting
    from looplm.model.halting_rules import KLHalt

    torch.manual_seed(0)
    coda = looplm.build_model("tiny", "scse", coda_layers=1, dropout=0.0).double().eval()
    x = torch.randint(0, 257, (2, 8))
    for h in (
        maxtoken_forward(coda, x, torch.ones_like(x, dtype=torch.bool), 0.0, 4)[0],
        per_token_halting(coda, x, KLHalt(0.0), 4)[0],
    ):  # no token halts: what the readout reads at the ceiling, through the coda
        torch.testing.assert_close(coda.readout(h), coda(x, loops=4))
    graph = looplm.build_model(
        "tiny", "looped", d_model=32, n_heads=2, d_ff=64, dropout=0.0, attention="adjacency",
        positions="none",
    ).double().eval()  # fmt: skip
    b = make_batch("graph_nodes", 3, (2, 3), seed=0)
    (h,) = graph.hidden_states(b.input_ids, 5)
    dense, depth = per_token_halting(graph, b.input_ids, KLHalt(0.0), 5)
    assert bool((depth == 5).all())
    torch.testing.assert_close(dense, h)  # the halting path uses the graph's mask
    h_mt, _ = maxtoken_forward(graph, b.input_ids, b.targets != -100, 0.0, 5)
    torch.testing.assert_close(h_mt, h)


def test_graph_nodes_in_degree_says_nothing_about_the_label() -> None:
    """A node sees its in-neighbour count after one attention layer; the label must not."""
    for depth in (2, 4, 8):
        rng = random.Random(100 + depth)
        counts = {"Y": [0] * 8, "N": [0] * 8}
        for _ in range(600):
            ex = graph_nodes_example(rng, depth)
            edges, _, _ = _parse(ex.text)
            for i, a in ex.answers.items():
                deg = sum(1 for _u, v in edges if v == ex.text[i])
                counts[a][min(deg, 7)] += 1
        for deg in range(8):
            y, n = counts["Y"][deg], counts["N"][deg]
            assert abs(y - n) <= 4 * (y + n + 1) ** 0.5 + 5, (depth, deg, counts)
