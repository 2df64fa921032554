"""RetroInfer on the plain-torch engine (no SGLang): after the prompt, the cold rows' slots go back
to the allocator and their K / V to the host tier; a decode layer's output (the method's
``ComputedDecodeView``) equals ``sgl_kernel_sparse.retro``'s tripartite attention on the original
tensors, its retrieved clusters are the top ones by q . centroid (a loop reference), estimation
brings it close to dense attention where retrieval alone is far; the two tiers (page layout,
CLOCK replacement, hits, misses, bytes, copies, a fetch larger than the pool) and config errors."""

from __future__ import annotations

import pytest
import torch
from sgl_kernel_sparse.retro import build_wave_index, retro_decode_attention

import single_request as one
from sglang_sparse.core.events import StepMode
import numpy as np

from sglang_sparse.core.tiered_store import HostRows, PageCache, page_layout
from sglang_sparse.core.views import ComputedDecodeView
from sglang_sparse.methods.retroinfer import LayerIndex, RetroInferRuntime, select_clusters, tripartite
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, D, ToyEngine, qkv

KNOBS = {"segment": 32, "tokens_per_cluster": 4, "retrieve": 3, "sinks": 2, "local": 4, "kmeans_iters": 5}
SCALE = D ** -0.5


def decoded(eng, rid="a", seed=100):
    dq, dk, dv = qkv(1, seed=seed)
    eng.views.clear()
    eng.decode(rid, 0, dq, dk, dv)
    views = dict(eng.views)
    assert all(isinstance(v, ComputedDecodeView) for v in views.values())
    return dq, dk, dv, views


def test_decode_equals_the_tripartite_reference_and_cold_slots_are_released():
    length, c = 60, KNOBS
    q, k, v = qkv(length, seed=1)
    eng = ToyEngine("retroinfer", KNOBS)
    rt: RetroInferRuntime = eng.ctl.runtime
    assert rt.evicts_kv and not rt.supports_chains and type(rt).decode_needs_python()
    free0 = eng.store.free_count()
    freed = eng.prefill("a", 0, q, k, v, chunk=25)
    cold = length - c["sinks"] - c["local"]
    assert freed == cold and eng.store.free_count() == free0 - c["sinks"] - c["local"]
    assert rt.host.bytes_used == LAYERS * 2 * cold * HKV * D * 4  # float32 K and V of every cold row
    assert rt.index_bytes == rt.index_nbytes(cold) == sum(x.nbytes for x in rt.indexes["a"])
    dq, dk, dv, views = decoded(eng)
    for layer in range(LAYERS):
        cold_k, cold_v = k[layer][c["sinks"]: length - c["local"]], v[layer][c["sinks"]: length - c["local"]]
        ref_idx = build_wave_index(cold_k, cold_v, c["segment"], c["tokens_per_cluster"], c["kmeans_iters"])
        mine = rt.indexes["a"][layer]
        torch.testing.assert_close(mine.centroids, ref_idx.centroids)
        # the reference reads index rows [0, cold) then the steady rows: sinks, local, this token
        k_all = torch.cat([cold_k, k[layer][: c["sinks"]], k[layer][length - c["local"]:], dk[layer]])
        v_all = torch.cat([cold_v, v[layer][: c["sinks"]], v[layer][length - c["local"]:], dv[layer]])
        steady = torch.arange(cold, k_all.shape[0])
        want = retro_decode_attention(dq[layer][0], k_all, v_all, ref_idx, steady, c["retrieve"], SCALE)
        got = views[layer].attend(SCALE)
        assert got.shape == (1, HQ, D)
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)
    assert rt.tiers.misses > 0 and rt.tiers.hits == 0  # every page came from the host tier once
    misses = rt.tiers.misses
    views[0].attend(SCALE)  # the same query again: its clusters are on the device now
    assert rt.tiers.misses == misses and rt.tiers.hits > 0
    eng.finish("a", 0)
    assert rt.host.bytes_used == 0 and rt.tiers.bytes_used == 0 and rt.index_bytes == 0
    assert eng.store.free_count() == free0


def reference_top(q, centroids, sizes, n):
    """Per query head: the n non-empty clusters of highest q . centroid, ties to the lower id."""
    out = []
    for h in range(q.shape[0]):
        scored = [(float(q[h] @ centroids[c]), c) for c in range(centroids.shape[0]) if sizes[c] > 0]
        out.append(sorted(c for _, c in sorted(scored, key=lambda t: (-t[0], t[1]))[:n]))
    return out


@pytest.mark.parametrize("n", [1, 3, 50])
def test_selected_clusters_are_the_top_ones_by_query_centroid_score(n):
    g = torch.Generator().manual_seed(7)
    cent = torch.randn(12, D, generator=g)
    sizes = torch.randint(0, 4, (12,), generator=g)
    sizes[3] = 0
    cent[5] = cent[6]  # a tie: the lower id first
    q = torch.randn(3, D, generator=g)
    _, mask = select_clusters(q, cent, sizes, n)
    assert [mask[h].nonzero().flatten().tolist() for h in range(3)] == reference_top(q, cent, sizes, n)


def clustered_keys(n, centers, noise, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centers, HKV, D, generator=g) * 2
    k = c[torch.randint(0, centers, (n,), generator=g)] + noise * torch.randn(n, HKV, D, generator=g)
    return k, torch.randn(n, HKV, D, generator=g)


def run_tripartite(k, v, res, retrieve, tpc=8, page_rows=3):
    """The method's attention over cold rows ``[0, len - res)`` (indexed, their K / V in a host
    tier, read through a page cache) and resident rows ``[len - res, len)``."""
    cold = k.shape[0] - res
    idx = build_wave_index(k[:cold], v[:cold], 64, tpc, 10)
    host = HostRows("cpu", 2 ** 30)
    in_order = idx.order.unsqueeze(-1).expand(-1, -1, D)
    host.put("r", 0, k[:cold].transpose(0, 1).gather(1, in_order), v[:cold].transpose(0, 1).gather(1, in_order),
             idx.offsets)
    cache = PageCache(host, "cpu", 4096, D, D, torch.float32, page_rows)
    cache.register("r", 0, idx.sizes)
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(9))
    scores, picked = select_clusters(q.view(HKV, -1, D), idx.centroids, idx.sizes, retrieve)
    heads, clusters = picked.any(dim=1).nonzero().T.numpy()
    pages = cache.gather(cache.fetch("r", 0, heads, clusters), HKV)
    layer = LayerIndex(idx.centroids, idx.sizes, idx.value_sums)
    out = tripartite(q, k[cold:], v[cold:], layer, scores, picked, pages, SCALE)
    return q, out, idx


def dense(q, k, v):
    return one.masked_decode_attention(q, k, v, torch.ones(HQ, k.shape[0], dtype=torch.bool))


def test_retrieving_every_cluster_is_exact_attention():
    k, v = clustered_keys(100, 6, 0.5, seed=3)
    q, out, idx = run_tripartite(k, v, res=10, retrieve=1000)
    torch.testing.assert_close(out, dense(q, k, v), rtol=1e-5, atol=1e-5)


def test_estimation_recovers_the_unretrieved_mass():
    """Tight clusters: the estimate of the clusters left out is close to their exact share, so the
    output is close to dense attention; attending the retrieved clusters and the resident rows
    alone (no estimation) is far from it."""
    k, v = clustered_keys(128, 4, 0.02, seed=4)
    q, out, idx = run_tripartite(k, v, res=8, retrieve=2)
    want = dense(q, k, v)
    assert (out - want).abs().max() < 0.02
    steady = torch.arange(120, 128)
    torch.testing.assert_close(out, retro_decode_attention(q, k, v, idx, steady, 2, SCALE), rtol=1e-5, atol=1e-5)
    without = torch.empty_like(out)  # the same zones with the estimation zone dropped
    for h in range(HQ):
        g = h // (HQ // HKV)
        picked = select_clusters(q[h: h + 1], idx.centroids[g], idx.sizes[g], 2)[1][0].nonzero().flatten().tolist()
        rows = torch.cat([idx.order[g, idx.offsets[g, c]: idx.offsets[g, c + 1]] for c in picked] + [steady])
        w = ((k[rows, g] @ q[h]) * SCALE).softmax(0)
        without[h] = w @ v[rows, g]
    assert (without - want).abs().max() > 10 * (out - want).abs().max()


def test_a_short_prompt_is_not_indexed_and_decodes_exactly():
    q, k, v = qkv(6, seed=2)  # sinks + local = 6
    eng = ToyEngine("retroinfer", KNOBS)
    assert eng.prefill("a", 0, q, k, v, chunk=4) == 0
    dq, dk, dv, views = decoded(eng)
    rt = eng.ctl.runtime
    assert "a" not in rt.indexes and rt.host.bytes_used == 0
    for layer in range(LAYERS):
        kk, vv = torch.cat([k[layer], dk[layer]]), torch.cat([v[layer], dv[layer]])
        torch.testing.assert_close(views[layer].attend(SCALE)[0], dense(dq[layer][0], kk, vv), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("full", ["host", "index"])
def test_a_full_tier_keeps_the_prompt_resident(full):
    q, k, v = qkv(60, seed=5)
    eng = ToyEngine("retroinfer", {**KNOBS, "index_mb": 1})
    rt = eng.ctl.runtime
    if full == "host":
        rt.host.capacity_bytes = 1000  # less than one layer's cold rows
    else:  # the device budget for indexes (1 MiB) is nearly spent
        rt.index_bytes = 2 ** 20 - rt.index_nbytes(60 - KNOBS["sinks"] - KNOBS["local"]) + 1
    assert eng.prefill("a", 0, q, k, v, chunk=60) == 0
    assert rt.counters[f"retro_{full}_full"] == 1 and rt.host.bytes_used == 0 and "a" not in rt.indexes
    dq, dk, dv, views = decoded(eng)
    kk, vv = torch.cat([k[1], dk[1]]), torch.cat([v[1], dv[1]])
    torch.testing.assert_close(views[1].attend(SCALE)[0], dense(dq[1][0], kk, vv), rtol=1e-5, atol=1e-5)


def test_two_requests_in_one_decode_step():
    eng = ToyEngine("retroinfer", KNOBS)
    for row, (rid, seed) in enumerate((("a", 11), ("b", 12))):
        q, k, v = qkv(40 + 10 * row, seed=seed)
        eng.prefill(rid, row, q, k, v, chunk=64)
    from sglang_sparse.core.events import RequestSlice
    slices = []
    for row, rid in enumerate(("a", "b")):
        ret = eng.ctl.cache.retained(rid)
        slices.append(RequestSlice(rid, row, ret.logical_len, ret.logical_len + 1, ret.n_rows,
                                   eng.ctl.cache.requests[rid].prompt_len))
    dq, dk, dv = qkv(2, seed=13)
    eng.views.clear()
    eng.run_step(StepMode.DECODE, slices, dq, dk, dv)
    out = dict(eng.views)[2].attend(SCALE)
    assert out.shape == (2, HQ, D)
    rt = eng.ctl.runtime
    for i, rid in enumerate(("a", "b")):  # each request reads its own index, pages and rows
        index = rt.indexes[rid][2]
        q = dq[2][i]
        scores, picked = select_clusters(q.view(HKV, -1, D), index.centroids, index.sizes, KNOBS["retrieve"])
        heads, clusters = picked.any(dim=1).nonzero().T.numpy()
        pages = rt.tiers.gather(rt.tiers.fetch(rid, 2, heads, clusters), HKV)
        slots = eng.store.row_slots(i, 0, slices[i].row_start + 1)
        want = tripartite(q, eng.store.k[2][slots], eng.store.v[2][slots], index, scores, picked, pages, SCALE)
        torch.testing.assert_close(out[i], want)


# -- the tiers ------------------------------------------------------------------------------
def host_with(rows_per_cluster=(2, 3, 1)):
    host = HostRows("cpu", capacity_bytes=10_000)
    n = sum(rows_per_cluster)
    k = torch.arange(n * D, dtype=torch.float32).view(1, n, D)
    offsets = torch.tensor([[0, *torch.tensor(rows_per_cluster).cumsum(0).tolist()]])
    assert host.put("r", 0, k, -k, offsets)
    return host, k


def test_page_layout_cuts_each_cluster_into_pages():
    lay = page_layout(("r", 0), np.array([[5, 0, 2], [1, 4, 0]]), page_rows=2)
    assert lay.start.tolist() == [[0, 3, 3, 4], [0, 1, 3, 3]]
    assert lay.row0[0].tolist() == [0, 2, 4, 5] and lay.length[0].tolist() == [2, 2, 1, 2]
    assert lay.cluster[0].tolist() == [0, 0, 0, 2]
    # head 1 has 3 pages (padded to head 0's 4): rows 0 | 1-2 | 3-4
    assert lay.row0[1, :3].tolist() == [0, 1, 3] and lay.length[1, :3].tolist() == [1, 2, 2]
    assert (lay.pool == -1).all()


def fetch_one(cache, c):
    return cache.fetch("r", 0, np.array([0]), np.array([c]))


def test_page_cache_hits_misses_bytes_and_copies():
    host, k = host_with()  # clusters of 2, 3, 1 rows; pages of 2 rows: 1, 2, 1 pages
    cache = PageCache(host, "cpu", capacity_rows=6, d_k=D, d_v=D, dtype=torch.float32, page_rows=2)
    cache.register("r", 0, torch.tensor([[2, 3, 1]]))
    page_bytes = 2 * 2 * D * 4
    assert cache.n_pages == 3 and cache.bytes_total == 3 * page_bytes and cache.bytes_used == 0
    f = fetch_one(cache, 1)  # rows [2, 5): two pages, the second one half full
    assert f.length.tolist() == [2, 1] and f.cluster.tolist() == [1, 1] and (cache.hits, cache.misses) == (0, 2)
    pages = cache.gather(f, 1)
    torch.testing.assert_close(pages.k[0, 0], k[0, 2:4])
    torch.testing.assert_close(pages.v[0, 1, :1], -k[0, 4:5])
    assert cache.k.data_ptr() != host.layers[("r", 0)].k.data_ptr()  # the pool is its own memory
    fetch_one(cache, 1)  # hit
    assert (cache.hits, cache.misses, cache.pages_used, cache.bytes_used) == (2, 2, 2, 2 * page_bytes)
    fetch_one(cache, 0)  # the last free page
    f = fetch_one(cache, 2)  # pool full: CLOCK clears every reference bit, then takes the hand's page
    assert cache.evictions == 1 and cache.pages_used == 3
    torch.testing.assert_close(cache.gather(f, 1).k[0, 0, :1], k[0, 5:6])
    evicted = [c for c in range(2) if (cache.layouts[("r", 0)].pool[0, cache.layouts[("r", 0)].start[0, c]:
                                                                       cache.layouts[("r", 0)].start[0, c + 1]] < 0).any()]
    assert evicted == [1]  # page 0 of the pool (cluster 1's first page) was under the hand
    misses = cache.misses
    fetch_one(cache, 1)  # reloaded: one page was evicted, the other still hits
    assert cache.misses == misses + 1
    cache.drop("r")
    assert cache.pages_used == 0 and cache.bytes_used == 0 and not cache.layouts


def test_clock_gives_a_recently_used_page_a_second_chance():
    host, k = host_with((2, 2, 2, 2))  # four one-page clusters, a pool of three pages
    cache = PageCache(host, "cpu", capacity_rows=6, d_k=D, d_v=D, dtype=torch.float32, page_rows=2)
    cache.register("r", 0, torch.tensor([[2, 2, 2, 2]]))
    pool = cache.layouts[("r", 0)].pool[0]
    for c in range(3):  # clusters 0, 1, 2 in pool pages 0, 1, 2, all referenced
        fetch_one(cache, c)
    fetch_one(cache, 3)  # the hand clears every bit, then takes page 0: cluster 0 goes
    assert pool.tolist() == [-1, 1, 2, 0] and cache.hand == 1
    fetch_one(cache, 1)  # a hit: cluster 1's page is referenced again
    fetch_one(cache, 0)  # the hand passes page 1 (second chance) and takes page 2: cluster 2 goes
    assert pool.tolist() == [2, 1, -1, 0] and cache.evictions == 2
    torch.testing.assert_close(cache.k[2], k[0, 0:2])  # cluster 0's rows, copied again


def test_pages_in_use_by_the_fetch_are_never_evicted_and_overflow_is_read_from_a_copy():
    host, k = host_with((4, 1))  # 2 + 1 pages of 2 rows
    cache = PageCache(host, "cpu", capacity_rows=4, d_k=D, d_v=D, dtype=torch.float32, page_rows=2)
    cache.register("r", 0, torch.tensor([[4, 1]]))
    f = cache.fetch("r", 0, np.array([0, 0]), np.array([0, 1]))  # 3 pages, room for 2
    assert sorted(f.page.tolist())[:1] == [-1] and f.extra_k.shape == (1, 2, D)
    assert cache.pages_used == 2 and cache.evictions == 0
    pages = cache.gather(f, 1)
    torch.testing.assert_close(pages.k[0, :3].reshape(-1, D)[:5], k[0, :5])


def test_host_rows_account_bytes_and_refuse_past_capacity():
    host, k = host_with()
    assert host.bytes_used == host.bytes_peak == 2 * k.nbytes and host.requests() == 1
    big = torch.zeros(1, 1000, D)
    assert not host.put("s", 0, big, big, torch.tensor([[0, 1000]]))  # over capacity: nothing stored
    assert host.bytes_used == 2 * k.nbytes
    assert host.drop("r") == 2 * k.nbytes and host.bytes_used == 0 and host.bytes_peak == 2 * k.nbytes


@pytest.mark.parametrize("knobs, message", [
    ({"tokens_per_cluster": 0}, "tokens_per_cluster=0 is out of range"),
    ({"segment": 8, "tokens_per_cluster": 16}, "tokens_per_cluster=16 must be at most segment=8"),
    ({"retrieve": 0}, "retrieve=0 is out of range"),
    ({"local": 0}, "local=0 is out of range"),
    ({"kmeans_iters": 0}, r"kmeans_iters=0 is out of range: must be in \[1, 100\]"),
    ({"host_mb": 0}, "host_mb=0 is out of range"),
    ({"index_mb": 0}, "index_mb=0 is out of range"),
    ({"page_rows": 0}, "page_rows=0 is out of range"),
    ({"page_rows": 16, "cache_rows": 8}, "page_rows=16 must be at most cache_rows=8"),
])
def test_config_errors_name_the_option(knobs, message):
    with pytest.raises(ConfigError, match=message):
        build_config("retroinfer", knobs)
