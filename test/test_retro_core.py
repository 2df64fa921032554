"""RetroInfer's numerics (``sgl_kernel_sparse.retro``) against plain definitions: the wave index
partitions each KV head's rows into clusters inside segments with centroid = member mean, the
retrieval zone is the top clusters by q . centroid, and the tripartite attention is exact when
every cluster is retrieved, exact when clusters are tight (estimation = the members), and closer
to dense attention than retrieval alone on clustered keys."""

from __future__ import annotations

import pytest
import torch

import single_request as one
from sgl_kernel_sparse.retro import build_wave_index, kmeans, retrieve_clusters, retro_decode_attention

HQ, HKV, D = 4, 2, 8


def clustered(n, centers, noise, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(centers, HKV, D, generator=g) * 3
    label = torch.randint(0, centers, (n,), generator=g)
    k = c[label] + noise * torch.randn(n, HKV, D, generator=g)
    v = torch.randn(n, HKV, D, generator=g)
    return k, v, label


def test_the_index_partitions_rows_within_segments_with_member_means():
    k, v, _ = clustered(70, 6, 0.3, seed=1)
    seg, tpc = 32, 8
    idx = build_wave_index(k, v, seg, tpc, iters=5)
    assert idx.num_clusters == 4 + 4 + 1  # ceil(32/8) + ceil(32/8) + ceil(6/8)
    for g in range(HKV):
        assert sorted(idx.order[g].tolist()) == list(range(70))
        assert int(idx.sizes[g].sum()) == 70 and int(idx.offsets[g, -1]) == 70
        for c in range(idx.num_clusters):
            rows = idx.order[g, idx.offsets[g, c]: idx.offsets[g, c + 1]]
            assert rows.numel() == idx.sizes[g, c]
            if rows.numel():
                assert len({int(r) // seg for r in rows}) == 1  # a cluster never crosses a segment
                torch.testing.assert_close(idx.centroids[g, c], k[rows, g].mean(0))
                torch.testing.assert_close(idx.value_sums[g, c], v[rows, g].sum(0))


def test_kmeans_recovers_separated_blobs():
    k, _, label = clustered(60, 3, 0.05, seed=2)
    assign, _ = kmeans(k[:, 0], 3, iters=10)
    # same partition up to renaming: each blob maps to one cluster and back
    pairs = set(zip(label.tolist(), assign.tolist()))
    assert len(pairs) == len(set(label.tolist())) == len({a for _, a in pairs})


def test_retrieval_takes_the_top_clusters_by_centroid_score():
    k, v, _ = clustered(64, 8, 0.5, seed=3)
    idx = build_wave_index(k, v, 64, 8, iters=3)
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(4))
    got = retrieve_clusters(q, idx, 3)
    for h in range(HQ):
        g = h // (HQ // HKV)
        scores = [(float(idx.centroids[g, c] @ q[h]), c) for c in range(idx.num_clusters) if idx.sizes[g, c] > 0]
        want = sorted(c for _, c in sorted(scores, key=lambda t: (-t[0], t[1]))[:3])
        assert got[h].tolist() == want


def dense(q, k, v, rows_n):
    mask = torch.ones(HQ, rows_n, dtype=torch.bool)
    return one.masked_decode_attention(q, k, v, mask)


def test_retrieving_every_cluster_is_exact_attention():
    k, v, _ = clustered(80, 5, 0.5, seed=5)
    idx = build_wave_index(k[:64], v[:64], 32, 8, iters=3)
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(6))
    steady = torch.arange(64, 80)  # recent / generated rows outside the index
    out = retro_decode_attention(q, k, v, idx, steady, n_retrieve=idx.num_clusters)
    torch.testing.assert_close(out, dense(q, k, v, 80), rtol=1e-5, atol=1e-5)


def test_estimation_is_exact_for_tight_clusters():
    """Members of a cluster with one key: estimating them by centroid and mean value is exact
    (the value mean times size is their sum), whatever is retrieved."""
    g = torch.Generator().manual_seed(7)
    blobs = torch.randn(4, HKV, D, generator=g) * 3
    # rows [10 b, 10 b + 10) share blob b's key; the evenly spaced init (rows 0, 10, 20, 30) seeds
    # one cluster per blob, so every cluster is one blob
    k = torch.cat([blobs.repeat_interleave(10, dim=0), torch.randn(8, HKV, D, generator=g)])
    v = torch.randn(48, HKV, D, generator=g)
    idx = build_wave_index(k[:40], v[:40], 40, 10, iters=10)
    assert idx.sizes.tolist() == [[10] * 4] * HKV
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(8))
    for r in (0, 1, 2):
        out = retro_decode_attention(q, k, v, idx, torch.arange(40, 48), n_retrieve=r)
        torch.testing.assert_close(out, dense(q, k, v, 48), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [9, 10, 11])
def test_estimation_brings_retrieval_closer_to_dense(seed):
    k, v, _ = clustered(512, 16, 0.3, seed=seed)
    v = v + k  # values correlated with keys, as in real layers: what estimation recovers
    idx = build_wave_index(k[:480], v[:480], 240, 16, iters=5)
    q = torch.randn(HQ, D, generator=torch.Generator().manual_seed(seed + 50)) * 0.5
    steady = torch.arange(480, 512)
    exact = dense(q, k, v, 512)
    est = retro_decode_attention(q, k, v, idx, steady, n_retrieve=4)
    # retrieval alone: the same exact zone, no estimation (rows of the 4 clusters + steady)
    picked = retrieve_clusters(q, idx, 4)
    mask = torch.zeros(HQ, 512, dtype=torch.bool)
    mask[:, 480:] = True
    for h in range(HQ):
        g = h // (HQ // HKV)
        for c in picked[h][picked[h] >= 0].tolist():
            mask[h, idx.order[g, idx.offsets[g, c]: idx.offsets[g, c + 1]]] = True
    only = one.masked_decode_attention(q, k, v, mask)
    assert (est - exact).norm() < 0.5 * (only - exact).norm()
