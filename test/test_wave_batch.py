"""A wave of decode evictions planned and compacted together (R-KV, H2O; engine-free, plain-torch
store): requests that reach their eviction at the same step hold the same number of rows, and
``plan_many`` + ``CacheManager.compact_rows_many`` handle them with work that does not grow with
their number (one read of the slot table, one gather of their positions, one move over every
layer of a flat pool). On a GPU every such operation is a kernel launch with host time around
it; before, each request of a wave cost its own launches (about 700 per batch of 15 at the
8B shape, docs/measured.md).

Checked: the batch's plans and compactions equal the same requests planned and compacted one at
a time (KV, maps, free slots), over a flat pool and over per-layer buffers alike; the number of
non-view torch operations of a wave batch is the same for 2 and 6 requests; a compaction batch
of two row counts moves KV once per count; a batch of unequal row counts is refused where it
must be (one slot-table read for a wave's plan)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.kv_store import TensorKVStore
from sglang_sparse.registry import build_config, get_method

LAYERS, HKV, D = 3, 2, 8
KNOBS = {"rkv": {"budget": 16, "window": 4, "interval": 8, "alpha": 0.3, "kernel": 3},
         "h2o": {"budget": 16, "recent": 6, "interval": 8}}


class PerLayerStore(TensorKVStore):
    """A store whose layers are separate buffers to its users (SGLang's own allocation, or an fp8
    pool stored as bytes): no flat cells, so moves and reads go layer by layer."""

    def flat_kv(self):
        raise RuntimeError("per-layer buffers")


def wave(method, count, flat=True, seed=0):
    """``count`` requests at their second decode eviction: each held ``budget + interval`` rows,
    was evicted back to ``budget`` (a per-head map), then decoded ``interval`` more rows. Returns
    the runtime and the request ids."""
    g = torch.Generator().manual_seed(seed)
    store = (TensorKVStore if flat else PerLayerStore)(LAYERS, 400, HKV, D, max_rows=8, max_len=64)
    cache = CacheManager(store, HKV)
    runtime = get_method(method).runtime_cls(cache, build_config(method, KNOBS[method]))
    budget, interval = KNOBS[method]["budget"], KNOBS[method]["interval"]
    rids = [f"r{i}" for i in range(count)]

    def grow(n):
        for r, rid in enumerate(rids):
            start = store.lengths[r]
            slots = store.alloc_rows(r, n)
            if rid not in cache.requests:
                cache.start(rid, r, n)
            cache.on_written(rid, n)
            for layer in range(LAYERS):
                store.write(layer, slots, torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g))
            assert store.lengths[r] == start + n
        runtime.scores.t.copy_(torch.rand(runtime.scores.t.shape, generator=g))

    grow(budget + interval)
    runtime._compact(rids, runtime.plan_many(rids))  # the first wave: per-head maps from here on
    grow(interval)
    return runtime, rids


def state(runtime, rids):
    cache = runtime.cache
    return ([cache.retained(rid).all_positions() for rid in rids],
            [[cache.keys(rid, layer) for layer in range(LAYERS)] for rid in rids],
            [[cache.values(rid, layer) for layer in range(LAYERS)] for rid in rids],
            cache.store.free_count(), dict(cache.counters))


def assert_same(a, b):
    for x, y in zip(a[:3], b[:3]):
        for u, v in zip(x, y):
            if isinstance(u, list):
                assert all(torch.equal(p, q) for p, q in zip(u, v))
            else:
                assert torch.equal(u, v)
    assert a[3:] == b[3:]


@pytest.mark.parametrize("method", ["rkv", "h2o"])
def test_a_wave_batch_equals_one_request_at_a_time_over_flat_and_per_layer_pools(method):
    batched, rids = wave(method, 5)
    plans = batched.plan_many(rids)
    freed = batched._compact(rids, plans)
    assert freed == [KNOBS[method]["interval"]] * 5
    single, _ = wave(method, 5)
    one = [single._compact([rid], single.plan_many([rid]))[0] for rid in rids]
    assert one == freed
    per_layer, _ = wave(method, 5, flat=False)
    assert per_layer.cache.flat_pool() is None and batched.cache.flat_pool() is not None
    per_layer._compact(rids, per_layer.plan_many(rids))
    assert_same(state(batched, rids), state(single, rids))
    assert_same(state(batched, rids), state(per_layer, rids))


class CountOps(TorchDispatchMode):
    """Non-view torch operations dispatched (on a GPU each is a kernel launch or a copy)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("method", ["rkv", "h2o"])
@pytest.mark.parametrize("flat", [True, False])
def test_a_wave_batch_costs_the_same_operations_for_two_requests_as_for_six(method, flat, monkeypatch):
    import sglang_sparse.core.cache_manager as cm

    counts, moves = {}, []
    flat_moves = cm.compact_kv
    monkeypatch.setattr(cm, "compact_kv", lambda *a, **kw: moves.append("flat") or flat_moves(*a, **kw))
    monkeypatch.setattr(PerLayerStore, "move_kv", lambda self, *a: moves.append("layer") or TensorKVStore.move_kv(self, *a))
    for count in (2, 6):
        runtime, rids = wave(method, count, flat=flat)
        moves.clear()
        with CountOps() as ops:
            runtime._compact(rids, runtime.plan_many(rids))
        counts[count] = ops.ops
        # a flat pool: one move over every layer's cells; per-layer buffers: one per layer
        assert moves == (["flat"] if flat else ["layer"] * LAYERS), moves
    assert len(counts[2]) == len(counts[6]), (len(counts[2]), len(counts[6]))


def test_resident_slots_of_a_wave_are_one_row_count():
    runtime, rids = wave("rkv", 3)
    cache = runtime.cache
    slots = cache.resident_slots_many(rids)
    assert slots.shape == (3, 24) and all(torch.equal(slots[i], cache.resident_slots(rid)) for i, rid in enumerate(rids))
    cache.store.alloc_rows(0, 1)
    cache.on_written("r0", 1)
    with pytest.raises(ValueError, match=r"requests hold \[24, 25\] rows: one count only"):
        cache.resident_slots_many(rids)
    assert runtime.plan_batch == 32768 // 24  # CPU: 32K rows per batch (EvictingRuntime.wave_batch)


def mixed(held, seed=1):
    """Requests holding ``held[i]`` identity rows each (a prefill just written), random KV."""
    g = torch.Generator().manual_seed(seed)
    store = TensorKVStore(LAYERS, 400, HKV, D, max_rows=8, max_len=64)
    cache = CacheManager(store, HKV)
    for r, n in enumerate(held):
        slots = store.alloc_rows(r, n)
        cache.start(f"r{r}", r, n)
        cache.on_written(f"r{r}", n)
        for layer in range(LAYERS):
            store.write(layer, slots, torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g))
    return cache


def test_a_batch_of_two_row_counts_compacts_in_one_move_per_count(monkeypatch):
    import sglang_sparse.core.cache_manager as cm

    held, budget = [20, 24, 20, 24, 24, 20], 12
    g = torch.Generator().manual_seed(2)
    rows = torch.stack([torch.stack([torch.stack([torch.randperm(n, generator=g)[:budget].sort().values
                                                  for _ in range(HKV)]) for _ in range(LAYERS)]) for n in held])
    rids = [f"r{i}" for i in range(len(held))]
    moves = []
    flat_moves = cm.compact_kv
    monkeypatch.setattr(cm, "compact_kv", lambda *a, **kw: moves.append("flat") or flat_moves(*a, **kw))
    batched = mixed(held)
    assert batched.compact_rows_many(rids, rows) == [n - budget for n in held]
    assert moves == ["flat", "flat"]  # one per row count (20 and 24), not one per request
    single = mixed(held)
    assert [single.compact_rows(rid, rows[i]) for i, rid in enumerate(rids)] == [n - budget for n in held]
    sides = []
    for cache in (batched, single):
        sides.append(([cache.retained(rid).all_positions() for rid in rids],
                      [[cache.keys(rid, layer) for layer in range(LAYERS)] for rid in rids],
                      [[cache.values(rid, layer) for layer in range(LAYERS)] for rid in rids],
                      cache.store.free_count(), dict(cache.counters)))
    assert_same(*sides)
    assert torch.equal(batched.retained("r1").all_positions(), rows[1])  # identity map: row r held position r
