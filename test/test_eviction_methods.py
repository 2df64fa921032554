"""Eviction methods on the toy engine (no SGLang): StreamingLLM keeps exactly sinks + recent,
PyramidKV's per-layer budgets and kept indices equal a reference written from the formulas, and
its compaction frees each layer's own dropped rows; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from toy_engine import HKV, LAYERS, ToyEngine, qkv


def _expected_streaming(n: int, sinks: int, recent: int) -> torch.Tensor:
    if n <= sinks + recent:
        return torch.arange(n)
    return torch.cat([torch.arange(sinks), torch.arange(n - recent, n)])


@pytest.mark.parametrize("chunk", [64, 7])
def test_streamingllm_keeps_exactly_sinks_and_recent_after_every_step(chunk):
    sinks, recent = 2, 8
    q, k, v = qkv(40, seed=5)
    eng = ToyEngine("streamingllm", {"sinks": sinks, "recent": recent, "evict_every": 1})
    free0 = eng.store.free_count()
    assert eng.prefill("a", 0, q, k, v, chunk) == 40 - sinks - recent
    keys = [k[layer].clone() for layer in range(LAYERS)]
    for step in range(20):
        dq, dk, dv = qkv(1, seed=100 + step)
        eng.decode("a", 0, dq, dk, dv)
        for layer in range(LAYERS):
            keys[layer] = torch.cat([keys[layer], dk[layer]])
        ret = eng.ctl.cache.retained("a")
        want = _expected_streaming(ret.logical_len, sinks, recent)
        assert ret.n_rows == sinks + recent
        assert torch.equal(ret.positions, want.expand(LAYERS, HKV, -1))  # every layer and head
        for layer in range(LAYERS):  # and the rows hold those tokens' keys
            torch.testing.assert_close(eng.ctl.cache.keys("a", layer), keys[layer][want])
    assert eng.store.free_count() == free0 - (sinks + recent)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


@pytest.mark.parametrize("method,knobs", [("streamingllm", {"sinks": 2, "recent": 8, "evict_every": 4}),
                                           ("kivi", {"bits": 4, "group": 4, "residual": 8})])
def test_token_uniform_compaction_repoints_rows_without_moving_kv(method, knobs):
    """StreamingLLM and KIVI keep the same tokens in every layer and head: a compaction re-points
    the kept rows at their slots and frees the rest; no KV row is copied (before this, every
    eviction moved the whole window in every layer). Values stay readable and no slot leaks."""
    q, k, v = qkv(24, seed=7)
    eng = ToyEngine(method, knobs)
    moves = []
    real_move = eng.store.move_kv
    eng.store.move_kv = lambda *a: (moves.append(a[0]), real_move(*a))
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, 8)
    keys = [k[layer].clone() for layer in range(LAYERS)]
    for step in range(12):
        dq, dk, dv = qkv(1, seed=400 + step)
        eng.decode("a", 0, dq, dk, dv)
        keys = [torch.cat([keys[layer], dk[layer]]) for layer in range(LAYERS)]
    cache = eng.ctl.cache
    ret = cache.retained("a")
    assert cache.counters["compactions"] > 1 and moves == []
    held = ret.token_positions()
    assert held is not None and ret.n_rows < ret.logical_len
    for layer in range(LAYERS):  # the full-precision rows hold exactly those tokens' keys
        torch.testing.assert_close(cache.keys("a", layer), keys[layer][held])
    slots = cache.resident_slots("a")
    assert len(set(slots.tolist())) == len(slots)  # every row its own slot
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_streamingllm_evicts_every_n_tokens_and_stays_bounded():
    sinks, recent, every = 4, 16, 5
    q, k, v = qkv(10, seed=6)  # a short prompt: nothing to evict yet
    eng = ToyEngine("streamingllm", {"sinks": sinks, "recent": recent, "evict_every": every}, slots=64)
    free0 = eng.store.free_count()
    assert eng.prefill("a", 0, q, k, v, chunk=4) == 0
    seen = []
    for step in range(200):  # 210 tokens through a 64-slot pool
        dq, dk, dv = qkv(1, seed=300 + step)
        freed = eng.decode("a", 0, dq, dk, dv)
        ret = eng.ctl.cache.retained("a")
        seen.append(ret.n_rows)
        assert ret.n_rows <= sinks + recent + every
        if freed:
            assert freed == every and ret.n_rows == sinks + recent
            assert torch.equal(ret.positions[0, 0], _expected_streaming(ret.logical_len, sinks, recent))
    assert max(seen) == sinks + recent + every - 1 and min(seen[30:]) == sinks + recent
    assert eng.ctl.stats()["counters"]["slots_released"] == 210 - sinks - recent - (seen[-1] - sinks - recent)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_streamingllm_oracle_caps_decode_growth():
    from sglang_sparse.methods.streamingllm import StreamingLLMConfig, StreamingLLMRuntime
    from sglang_sparse.core.cache_manager import CacheManager
    from sglang_sparse.core.kv_store import TensorKVStore

    rt = StreamingLLMRuntime(CacheManager(TensorKVStore(1, 8, 1, 4), 1), StreamingLLMConfig(4, 100, 16))
    o = rt.oracle
    assert o.rows_after_prefill(1000) == 104 and o.rows_at(1000, 10_000) == 120
    assert o.decode_reserve(1000, 10_000) == 0  # the prompt's own rows cover the whole decode
    assert o.rows_at(10, 50) == 60 and o.rows_at(10, 500) == 120
    assert o.decode_growth(1000, 10_000) == 16


# ------------------------------------------------------------------ PyramidKV


def _pyramid_by_formula(L, C, w, layers, beta=20):
    """PyramidKV's budgets as its paper's code computes them (methods.md), written out again."""
    if L <= C:
        return [L] * layers
    if L < 2 * (C - w):
        return [C] * layers
    mn = (C - w) // beta
    mx = 2 * (C - w) - mn
    if mx > L - w:
        mx = L - w
        mn = 2 * (C - w) - mx
    step = (mx - mn) // (layers - 1)
    return [mx - i * step + w for i in range(layers)]


@pytest.mark.parametrize("L,C,w,layers", [(100, 24, 8, 3), (1000, 64, 8, 30), (120, 64, 8, 30),
                                          (60, 64, 8, 3), (130, 40, 4, 5), (33, 24, 8, 2)])
def test_pyramid_budgets_follow_the_formula(L, C, w, layers):
    from sglang_sparse.methods.pyramidkv import PyramidKVConfig, layer_budgets

    got = layer_budgets(PyramidKVConfig(budget=C, window=w), L, layers)
    assert got == _pyramid_by_formula(L, C, w, layers)
    assert all(b <= L for b in got) and got == sorted(got, reverse=True)


@pytest.mark.parametrize("chunk", [1000, 13])
def test_pyramidkv_keeps_reference_indices_per_layer_and_frees_each_layers_drops(chunk):
    from sgl_kernel_sparse import reference

    from sglang_sparse.core.events import RequestSlice
    from sglang_sparse.kernels.decode import decode_over_cells, decode_over_views
    import single_request as one

    length, budget, window = 100, 24, 8
    q, k, v = qkv(length, seed=11)
    eng = ToyEngine("pyramidkv", {"budget": budget, "window": window, "kernel": 5})
    free0 = eng.store.free_count()
    freed = eng.prefill("a", 0, q, k, v, chunk)
    budgets = _pyramid_by_formula(length, budget, window, LAYERS)
    engine_rows = -(-sum(budgets) // LAYERS)
    assert freed == length - engine_rows  # every layer's own drops, summed, in whole slots
    assert eng.store.free_count() == free0 - engine_rows
    assert len(set(budgets)) == LAYERS  # really per layer
    ret = eng.ctl.cache.retained("a")
    assert ret.per_layer and (ret.n_rows, ret.logical_len) == (engine_rows, length)
    for layer in range(LAYERS):
        want = reference.snapkv_keep_indices(q[layer][-window:], k[layer], budgets[layer], window, 5)
        assert torch.equal(ret.layer_positions(layer), want)
        for h in range(HKV):  # row i of head h in layer l holds want[h, i], wherever its cell is
            torch.testing.assert_close(eng.ctl.cache.keys("a", layer)[:, h], k[layer][want[h], h])
            torch.testing.assert_close(eng.ctl.cache.values("a", layer)[:, h], v[layer][want[h], h])
    # every kept cell lies in the request's slots, and no cell holds two rows
    cells = torch.cat([eng.ctl.cache.layer_cells("a", layer) for layer in range(LAYERS)])
    assert cells.unique().numel() == cells.numel() == sum(budgets)
    slots = eng.store.row_slots(0, 0, engine_rows)
    assert set((cells % eng.store.k.shape[1]).tolist()) <= set(slots.tolist())

    # decode: attention in each layer reads exactly that layer's kept rows + the new token
    dq, dk, dv = qkv(1, seed=12)
    eng.views.clear()
    eng.decode("a", 0, dq, dk, dv)
    ret = eng.ctl.cache.retained("a")
    assert (ret.n_rows, ret.logical_len) == (engine_rows + 1, length + 1)
    flat_k, flat_v = eng.store.flat_kv()
    batch = eng.decode_batch(0, [RequestSlice("a", 0, length, length + 1, engine_rows, length)], dq, dk)
    for layer, view in eng.views:
        # the graph-safe view: device tables name exactly this layer's cells, in row order
        assert type(view).__name__ == "CellsDecodeView" and view.layer == layer
        t = view.tables
        c, valid = reference.cell_table_cells(batch.table, batch.req_rows, batch.n_rows, t.entries, t.offset,
                                              t.count, t.packed_rows, layer, t.slots_per_layer)
        assert bool(valid.all()) and torch.equal(c[0], eng.ctl.cache.layer_cells("a", layer))
        c = c[0]
        assert c.numel() == budgets[layer] + 1
        full_k, full_v = torch.cat([k[layer], dk[layer]]), torch.cat([v[layer], dv[layer]])
        mask = torch.zeros(q[0].shape[1], length + 1, dtype=torch.bool)
        pos = ret.layer_positions(layer)
        for h in range(mask.shape[0]):
            mask[h, pos[h // (mask.shape[0] // HKV)]] = True
        want = one.masked_decode_attention(dq[layer][0], full_k, full_v, mask)
        n = c.numel()
        got = decode_over_views(dq[layer][0][None], flat_k, flat_v, c[None], [0],
                                [torch.arange(n).expand(mask.shape[0], n)],
                                [torch.ones(mask.shape[0], n, dtype=torch.bool)], [n], 1 / k[0].shape[-1] ** 0.5)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        fused = decode_over_cells(dq[layer], flat_k, flat_v, batch.table, batch.req_rows, batch.n_rows, t, layer,
                                  1 / k[0].shape[-1] ** 0.5)[0]  # the kernel the server runs
        torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0
    assert int(t.count[0].sum()) == int(t.packed_rows[0]) == 0  # the row reads its slot table again


def test_pyramidkv_tables_follow_row_reuse_and_chain_attach():
    """The device tables (CellTables) are cleared when a compacted request's row is reused, and
    rebuilt from a resumed map (Chain Cache attach) on the new row."""
    from sgl_kernel_sparse import reference

    q, k, v = qkv(100, seed=15)
    eng = ToyEngine("pyramidkv", {"budget": 24, "window": 8, "kernel": 5})
    t = eng.ctl.cache.cell_tables
    eng.prefill("a", 0, q, k, v, 1000)
    ret, meta = eng.ctl.cache.retained("a"), dict(eng.ctl.cache.requests["a"].metadata)
    assert ret.per_layer and int(t.packed_rows[0]) == ret.compacted_rows > 0
    slots = eng.store.row_slots(0, 0, ret.n_rows).clone()

    def view_cells(row, n_rows, layer):
        c, valid = reference.cell_table_cells(eng.store.table, torch.tensor([row]), torch.tensor([n_rows]),
                                              t.entries, t.offset, t.count, t.packed_rows, layer, t.slots_per_layer)
        return c[0][valid[0]]

    want = [eng.ctl.cache.layer_cells("a", layer) for layer in range(LAYERS)]
    # a chain resumes on another row: detach "a" without freeing (the chain holds the slots)
    eng.ctl.request_finished("a")
    assert int(t.packed_rows[0]) == 0 and int(t.count[0].sum()) == 0
    eng.store.table[3, : slots.numel()] = slots
    eng.ctl.request_resumed("b", 3, 100, ret, meta)
    for layer in range(LAYERS):
        assert torch.equal(view_cells(3, ret.n_rows, layer), want[layer])
    # row 0 now serves a short request: its view is its slot table, in every layer
    eng.store.release_row(0)
    short = [x[:10] for x in qkv(10, seed=16)[0]], [x[:10] for x in qkv(10, seed=16)[1]], \
        [x[:10] for x in qkv(10, seed=16)[2]]
    eng.prefill("c", 0, *short, 1000)
    for layer in range(LAYERS):
        assert torch.equal(view_cells(0, 10, layer), eng.store.cells(layer, eng.store.row_slots(0, 0, 10)))


def test_pyramidkv_frees_about_what_snapkv_frees_at_the_same_average_budget():
    q, k, v = qkv(400, seed=13)
    freed = {}
    for method in ("snapkv", "pyramidkv"):
        eng = ToyEngine(method, {"budget": 40, "window": 4, "kernel": 1})
        freed[method] = eng.prefill("a", 0, q, k, v, chunk=64)
    assert freed["pyramidkv"] >= 0.9 * freed["snapkv"], freed


def test_a_chunk_after_per_layer_rows_attends_exactly_the_kept_rows():
    """A resumed PyramidKV chain's next chunk: the prefill view names each layer's kept cells,
    and attention over them + the chunk (causal) equals attention over the full sequence masked
    to the kept positions."""
    from sglang_sparse.core.events import RequestSlice, StepMode
    from sglang_sparse.kernels.prefill import extend_over_cells

    length, extra = 100, 6
    q, k, v = qkv(length + extra, seed=14)
    eng = ToyEngine("pyramidkv", {"budget": 24, "window": 8, "kernel": 5})
    eng.prefill("a", 0, [x[:length] for x in q], [x[:length] for x in k], [x[:length] for x in v], 1000)
    ret = eng.ctl.cache.retained("a")
    kept = [ret.layer_positions(layer) for layer in range(LAYERS)]
    s = RequestSlice("a", 0, length, length + extra, ret.n_rows, length + extra)
    eng.views.clear()
    eng.run_step(StepMode.PREFILL, [s], [x[length:] for x in q], [x[length:] for x in k], [x[length:] for x in v])
    flat_k, flat_v = eng.store.flat_kv()
    hq = q[0].shape[1]
    for layer, view in eng.views:
        cells = view.cells[0]
        assert cells.numel() == kept[layer].shape[1]
        got = extend_over_cells(q[layer][length:], k[layer][length:], v[layer][length:], flat_k, flat_v,
                                cells, 1 / k[0].shape[-1] ** 0.5)
        for i in range(extra):  # chunk token i: the kept rows of its KV head, then chunk tokens <= i
            for h in range(hq):
                pos = torch.cat([kept[layer][h // (hq // HKV)], torch.arange(length, length + i + 1)])
                w = torch.softmax((k[layer][pos, h // (hq // HKV)] @ q[layer][length + i, h]) / k[0].shape[-1] ** 0.5, 0)
                torch.testing.assert_close(got[i, h], w @ v[layer][pos, h // (hq // HKV)], rtol=1e-5, atol=1e-5)


def test_decode_compactions_count_only_evictions_planned_at_a_decode_token():
    """``counters.decode_compactions`` (and ``timings_us.compaction_decode``) count the
    compactions planned at a decode token, not the prompt's: here the last prompt chunk's
    eviction is a prompt one, every later one a decode one."""
    sinks, recent, every = 4, 16, 5
    q, k, v = qkv(40, seed=7)  # 40 > sinks + recent: the prompt is evicted after its last chunk
    eng = ToyEngine("streamingllm", {"sinks": sinks, "recent": recent, "evict_every": every}, slots=128)
    assert eng.prefill("a", 0, q, k, v, chunk=8) > 0
    counters = eng.ctl.stats()["counters"]
    assert counters.get("decode_compactions", 0) == 0 and counters["compactions"] == 1
    decode_evictions = 0
    for step in range(23):
        dq, dk, dv = qkv(1, seed=400 + step)
        decode_evictions += eng.decode("a", 0, dq, dk, dv) > 0
    stats = eng.ctl.stats()
    assert decode_evictions == 23 // every
    assert stats["counters"]["decode_compactions"] == decode_evictions
    assert stats["counters"]["compactions"] == decode_evictions + 1
    assert 0 < stats["timings_us"]["compaction_decode"] <= stats["timings_us"]["compaction"]
    eng.finish("a", 0)
