"""The lifecycle contract driven by a plain-torch engine (TensorKVStore), no SGLang: hook order,
SnapKV compaction and slot release, Quest page selection, leak-freedom, config validation."""

from __future__ import annotations

import copy

import pytest
import torch

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.events import DecodeBatch, LayerInput, RequestSlice, StepInfo, StepMode
from sglang_sparse.core.kv_store import TensorKVStore
from sgl_kernel_sparse import reference

import single_request as one
from sglang_sparse.kernels.decode import decode_over_pages, decode_over_views
from sglang_sparse.registry import ConfigError, build_config, get_method, method_names

from toy_engine import HKV, HQ, LAYERS, D, ToyEngine, qkv  # noqa: E402


@pytest.mark.parametrize("chunk", [1000, 37, 5])
def test_snapkv_compaction_keeps_reference_selection_and_frees_the_rest(chunk):
    length, budget, window = 100, 24, 8
    q, k, v = qkv(length, seed=1)
    eng = ToyEngine("snapkv", {"budget": budget, "window": window, "kernel": 5})
    free0 = eng.store.free_count()
    freed = eng.prefill("a", 0, q, k, v, chunk)
    assert freed == length - budget
    assert eng.store.free_count() == free0 - budget  # free count rose by exactly the evicted rows
    ret = eng.ctl.cache.retained("a")
    assert (ret.logical_len, ret.n_rows, ret.offset) == (length, budget, length - budget)
    for layer in range(LAYERS):
        want = reference.snapkv_keep_indices(q[layer][-window:], k[layer], budget, window, 5)
        assert torch.equal(ret.positions[layer], want)  # same selection, whatever the chunking
        # row i of head h now holds the KV of logical position want[h, i]
        for h in range(HKV):
            torch.testing.assert_close(eng.ctl.cache.keys("a", layer)[:, h], k[layer][want[h], h])
            torch.testing.assert_close(eng.ctl.cache.values("a", layer)[:, h], v[layer][want[h], h])
    stats = eng.ctl.stats()
    assert stats["counters"]["slots_released"] == length - budget
    assert (stats["logical_tokens"], stats["retained_tokens"]) == (length, budget)


def test_snapkv_decode_appends_after_compaction_and_nothing_leaks():
    q, k, v = qkv(60, seed=2)
    eng = ToyEngine("snapkv", {"budget": 20, "window": 4, "kernel": 1})
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, chunk=16)
    dq, dk, dv = qkv(1, seed=3)
    eng.decode("a", 0, dq, dk, dv)
    ret = eng.ctl.cache.retained("a")
    assert (ret.logical_len, ret.n_rows) == (61, 21)
    assert ret.positions[:, :, -1].eq(60).all()  # the new token's row holds logical position 60
    torch.testing.assert_close(eng.ctl.cache.keys("a", 1)[-1], dk[1][0])
    # Decode attention over the 21 resident rows == attention over the same logical positions of
    # the uncompressed sequence (per KV head: its own kept positions).
    full_k, full_v = torch.cat([k[1], dk[1]]), torch.cat([v[1], dv[1]])
    mask = torch.zeros(HQ, 61, dtype=torch.bool)
    for h in range(HQ):
        mask[h, ret.positions[1][h // (HQ // HKV)]] = True
    expected = one.masked_decode_attention(dq[1][0], full_k, full_v, mask)
    row = eng.ctl.cache.requests["a"].req_row  # the CPU decode path over the 21 resident rows
    got = decode_over_views(dq[1][0][None], eng.store.k[1], eng.store.v[1], eng.store.table, [row],
                            [torch.arange(21).expand(HQ, 21)], [torch.ones(HQ, 21, dtype=torch.bool)], [21],
                            1 / D ** 0.5)[0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_snapkv_short_prompt_is_not_compressed():
    q, k, v = qkv(20, seed=4)
    eng = ToyEngine("snapkv", {"budget": 32, "window": 4})
    assert eng.prefill("a", 0, q, k, v, chunk=8) == 0
    assert eng.ctl.cache.retained("a").is_identity


def test_quest_view_matches_reference_pages_and_keeps_dense_layers():
    length, page, budget = 70, 16, 32
    q, k, v = qkv(length, seed=5)
    eng = ToyEngine("quest", {"page_size": page, "token_budget": budget, "dense_layers": 1}, page_size=page)
    # A finished request leaves stale summaries on the pages "a" is then given (in another order).
    oq, ok, ov = qkv(40, seed=9)
    eng.prefill("old", 1, [x * 5 for x in oq], [x * 5 for x in ok], ov, chunk=40)
    eng.finish("old", 1)
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, chunk=30)
    dq, dk, dv = qkv(1, seed=6)
    eng.views.clear()
    eng.decode("a", 0, dq, dk, dv)
    assert eng.store.free_count() == free0 - 5 * page  # Quest keeps everything resident (5 pages)
    views = dict(eng.views)
    assert views[0] is None  # dense layer
    for layer in range(1, LAYERS):
        full_k = torch.cat([k[layer], dk[layer]])
        full_v = torch.cat([v[layer], dv[layer]])
        kmin, kmax = reference.quest_page_summaries(full_k, page)
        want = one.quest_select_pages(dq[layer][0], kmin, kmax, budget, page)  # [HQ, 3]
        view = views[layer]
        got = view.page_ids[0]
        assert (got >= 0).all() and torch.equal(got.sort(dim=-1).values, want.long())
        # attention over the view (paged kernel path) == reference attention over those tokens
        mask = torch.zeros(HQ, length + 1, dtype=torch.bool)
        for h in range(HQ):
            rows = (want[h].view(-1, 1) * page + torch.arange(page)).flatten()
            mask[h, rows[rows < length + 1]] = True
        expected = one.masked_decode_attention(dq[layer][0], full_k, full_v, mask)
        dense = one.masked_decode_attention(dq[layer][0], full_k, full_v, torch.ones_like(mask))
        assert not torch.allclose(expected, dense)  # the selection really changes what is read
        out = decode_over_pages(dq[layer], eng.store.k[layer], eng.store.v[layer], eng.store.table,
                                torch.tensor([0]), view.page_ids, view.n_rows, page, 1 / D ** 0.5)
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    assert eng.ctl.stats()["counters"]["pages_selected"] == (LAYERS - 1) * HQ * 3
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_dense_runs_every_hook_without_changes():
    q, k, v = qkv(10, seed=7)
    eng = ToyEngine("dense")
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, chunk=4)
    assert all(view is None for _, view in eng.views)
    assert eng.ctl.stats()["retained_tokens"] == 10
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_registry_and_validation_messages():
    assert {"dense", "quest", "snapkv"} <= set(method_names())
    with pytest.raises(ConfigError, match="unknown sparse method 'snapkvv'; available: .*snapkv"):
        get_method("snapkvv")
    with pytest.raises(ConfigError, match=r"budget=8 is out of range: must be >= 33"):
        build_config("snapkv", {"budget": 8, "window": 32})
    with pytest.raises(ConfigError, match="kernel=4 must be odd"):
        build_config("snapkv", {"kernel": 4})
    with pytest.raises(ConfigError, match="has no option page_budget"):
        build_config("quest", {"page_budget": 3})
    with pytest.raises(ConfigError, match=r"page_size=0 is out of range"):
        build_config("quest", {"page_size": 0})


def test_layer_hooks_are_skipped_only_for_runtimes_without_any():
    assert not ToyEngine("dense").ctl.layer_hooks
    assert ToyEngine("quest").ctl.layer_hooks
    assert ToyEngine("snapkv").ctl.layer_hooks


def test_snapkv_resumes_a_chain_and_recompacts_over_logical_positions():
    """Chain Cache at the contract level: a request resumes another's compacted rows (P < N);
    its suffix is prefilled after them and the next compaction keeps logical positions that are
    either previously kept ones or suffix ones, as the reference picks over the resident rows."""
    budget, window = 24, 4
    q, k, v = qkv(100, seed=11)
    eng = ToyEngine("snapkv", {"budget": budget, "window": window, "kernel": 1})
    eng.prefill("a", 0, q, k, v, chunk=40)
    old = eng.ctl.cache.retained("a")
    parked, meta = copy.deepcopy(old), dict(eng.ctl.cache.requests["a"].metadata)
    eng.ctl.request_finished("a")  # the chain keeps row 0 and its slots (no release_row)
    assert (parked.logical_len, parked.n_rows) == (100, budget)
    sq, sk, sv = qkv(30, seed=12)  # the continuation's suffix: logical positions [100, 130)
    ref = copy.deepcopy(parked)  # `parked` itself becomes b's live map
    eng.ctl.request_resumed("b", 0, 130, parked, meta)
    s = RequestSlice("b", 0, 100, 130, budget, 130)
    freed = eng.run_step(StepMode.PREFILL, [s], sq, sk, sv)
    assert freed == 30  # 24 + 30 rows -> 24
    ret = eng.ctl.cache.retained("b")
    assert (ret.logical_len, ret.n_rows, ret.offset) == (130, budget, 106)
    for layer in range(LAYERS):
        pos = ref.positions[layer]  # [HKV, 24] logical positions of the resumed rows
        old_k = torch.stack([k[layer][pos[h], h] for h in range(HKV)], dim=1)  # [24, HKV, D]
        rows_k = torch.cat([old_k, sk[layer]])  # the 54 resident rows in row order
        picked = reference.snapkv_keep_indices(sq[layer][-window:], rows_k, budget, window, 1)
        held = torch.cat([pos, torch.arange(100, 130).expand(HKV, 30)], dim=1)
        assert torch.equal(ret.positions[layer], held.gather(1, picked))
        assert not torch.equal(ret.positions[layer], picked)  # rows are not logical positions here


def test_compact_rows_equals_compact_by_positions_and_refuses_rows_it_does_not_hold():
    """``CacheManager.compact_rows`` (a plan in rows, H2O / R-KV) moves the same KV, keeps the
    same map and frees the same slots as ``compact`` given the rows' logical positions, also on a
    per-head map left by an earlier compaction."""
    def make():
        store = TensorKVStore(LAYERS, 64, HKV, D)
        cache = CacheManager(store, HKV)
        store.alloc_rows(0, 20)
        cache.start("r", 0, 20)
        cache.on_written("r", 20)
        g = torch.Generator().manual_seed(3)
        for layer in range(LAYERS):
            slots = store.row_slots(0, 0, 20)
            store.write(layer, slots, torch.randn(20, HKV, D, generator=g), torch.randn(20, HKV, D, generator=g))
        first = torch.rand(LAYERS, HKV, 20, generator=g).argsort(-1)[..., :12].sort(-1).values
        cache.compact_rows("r", first)  # a per-head map: row i holds a different position per head
        store.alloc_rows(0, 3)
        cache.on_written("r", 3)
        return store, cache

    rows = torch.rand(LAYERS, HKV, 15, generator=torch.Generator().manual_seed(4)).argsort(-1)[..., :9].sort(-1).values
    a_store, a = make()
    b_store, b = make()
    positions = a.retained("r").all_positions().gather(2, rows)
    freed_a = a.compact("r", positions)
    freed_b = b.compact_rows("r", rows)
    assert freed_a == freed_b == 15 - 9 and a_store.free_count() == b_store.free_count()
    assert torch.equal(a.retained("r").all_positions(), b.retained("r").all_positions())
    assert torch.equal(a.retained("r").all_positions(), positions)
    for layer in range(LAYERS):
        assert torch.equal(a.keys("r", layer), b.keys("r", layer)) and torch.equal(a.values("r", layer), b.values("r", layer))
    with pytest.raises(IndexError, match="kept rows must lie in"):
        b.compact_rows("r", torch.arange(7, 10).expand(LAYERS, HKV, 3))
    with pytest.raises(ValueError, match="strictly ascending"):  # a repeated row would corrupt the map
        b.compact_rows("r", torch.tensor([0, 2, 2]).expand(LAYERS, HKV, 3))
    with pytest.raises(ValueError, match=r"\[layers, kv_heads, B\]"):
        b.compact_rows("r", torch.arange(3).expand(HKV, 3))


def _wave(device="cpu"):
    """Three requests of 20, 17 and 9 rows (r0 already compacted once, per head, then 3 more
    rows); the store's KV and slot table on ``device``."""
    store = TensorKVStore(LAYERS, 128, HKV, D)
    store.k, store.v, store.table = store.k.to(device), store.v.to(device), store.table.to(device)
    cache = CacheManager(store, HKV)
    g = torch.Generator().manual_seed(5)
    for r, n in enumerate((20, 17, 9)):
        store.alloc_rows(r, n)
        cache.start(f"r{r}", r, n)
        cache.on_written(f"r{r}", n)
        for layer in range(LAYERS):
            slots = store.row_slots(r, 0, n)
            store.write(layer, slots, torch.randn(n, HKV, D, generator=g).to(device),
                        torch.randn(n, HKV, D, generator=g).to(device))
    # r0's positions are not its rows
    cache.compact_rows("r0", torch.rand(LAYERS, HKV, 20, generator=g).argsort(-1)[..., :12].sort(-1).values.to(device))
    store.alloc_rows(0, 3)
    cache.on_written("r0", 3)
    return store, cache


def _wave_rows():
    g = torch.Generator().manual_seed(6)
    return torch.stack([torch.rand(LAYERS, HKV, 15, generator=g).argsort(-1)[..., :9].sort(-1).values,
                        torch.rand(LAYERS, HKV, 17, generator=g).argsort(-1)[..., :9].sort(-1).values,
                        torch.arange(9).expand(LAYERS, HKV, 9)])  # r2 holds 9 rows: nothing to drop


@pytest.mark.gpu
def test_compact_rows_many_on_the_gpu_equals_the_cpu():
    """On CUDA the wave's positions are gathered and kept on the device (int32): the same maps,
    KV and free slots as the CPU's path."""
    a_store, a = _wave()
    b_store, b = _wave("cuda")
    rows = _wave_rows()
    assert b.compact_rows_many(["r0", "r1", "r2"], rows.cuda()) == a.compact_rows_many(["r0", "r1", "r2"], rows)
    assert b.retained("r1").kept.is_cuda and b.retained("r1").kept.dtype == torch.int32
    assert a_store.free_count() == b_store.free_count()
    for i in range(3):
        assert torch.equal(a.retained(f"r{i}").all_positions(), b.retained(f"r{i}").all_positions())
        for layer in range(LAYERS):
            assert torch.equal(a.keys(f"r{i}", layer), b.keys(f"r{i}", layer).cpu())


def test_compact_rows_many_equals_one_by_one():
    """``CacheManager.compact_rows_many`` (a wave of decode evictions planned together) leaves
    every request as ``compact_rows`` one at a time would: same KV, map and free slots; a request
    already within the kept count is left alone; a bad plan refuses the batch before any move."""
    make = _wave
    rows = _wave_rows()
    a_store, a = make()
    b_store, b = make()
    # one by one through the positions path (CacheManager.compact: a search back to rows, its own moves)
    one_by_one = [a.compact(f"r{i}", a.retained(f"r{i}").all_positions().gather(2, rows[i]))
                  if rows.shape[3] < a.retained(f"r{i}").n_rows else 0 for i in range(3)]
    assert b.compact_rows_many(["r0", "r1", "r2"], rows) == one_by_one == [15 - 9, 17 - 9, 0]
    assert a_store.free_count() == b_store.free_count() and b.counters == a.counters
    for i in range(3):
        assert torch.equal(a.retained(f"r{i}").all_positions(), b.retained(f"r{i}").all_positions())
        for layer in range(LAYERS):
            assert torch.equal(a.keys(f"r{i}", layer), b.keys(f"r{i}", layer))
            assert torch.equal(a.values(f"r{i}", layer), b.values(f"r{i}", layer))
    # off the CPU the positions stay on the device as int32 (RetainedMap.device_kept); the host
    # reads int64, a copy (a parked chain) holds them on the host, and the next wave goes on from them
    ret = b.retained("r1")
    assert ret.device_kept(torch.device("cpu"), torch.int32).dtype == torch.int32
    parked = copy.deepcopy(ret)
    assert parked.kept.dtype == torch.int64 and torch.equal(parked.all_positions(), a.retained("r1").all_positions())
    assert ret.kept.dtype == torch.int32  # the copy left the original where it was
    for cache, store in ((a, a_store), (b, b_store)):
        for r in (0, 1):
            store.alloc_rows(r, 2)
            cache.on_written(f"r{r}", 2)
    again = torch.stack([torch.arange(1, 11).expand(LAYERS, HKV, 10)] * 2)
    assert b.compact_rows_many(["r0", "r1"], again) == [
        a.compact(f"r{r}", a.retained(f"r{r}").all_positions().gather(2, again[r])) for r in (0, 1)]
    for r in (0, 1):
        assert b.retained(f"r{r}").all_positions().dtype == torch.int64
        assert torch.equal(a.retained(f"r{r}").all_positions(), b.retained(f"r{r}").all_positions())
    uniform = a.retained("r2")
    uniform.keep(torch.arange(3, 9).expand(LAYERS, HKV, 6))
    assert copy.deepcopy(uniform).token_positions() is not None  # a token-uniform map stays uniform in a copy
    _, c = make()
    before = [c.keys("r1", layer).clone() for layer in range(LAYERS)]
    bad = torch.stack([torch.arange(9).expand(LAYERS, HKV, 9), torch.arange(9, 18).expand(LAYERS, HKV, 9)])
    with pytest.raises(IndexError, match="kept rows must lie in"):  # r1 holds 17 rows: row 17 is not one
        c.compact_rows_many(["r0", "r1"], bad)
    with pytest.raises(ValueError, match="strictly ascending"):
        c.compact_rows_many(["r0", "r1"], torch.tensor([0, 2, 2]).expand(2, LAYERS, HKV, 3))
    assert c.retained("r1").n_rows == 17 and c.retained("r0").n_rows == 15  # nothing compacted
    assert all(torch.equal(before[layer], c.keys("r1", layer)) for layer in range(LAYERS))
