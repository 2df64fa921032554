"""RetroInfer's numerics (Chen et al., VLDB 2025), plain torch: the wave index over one request's
prompt keys and the tripartite decode attention over it. The method runtime and its tiered
payload build on these; they are also the references a Triton kernel is tested against.

Wave index (per KV head): the prompt is cut into segments of ``segment`` tokens and the keys of
each segment are clustered by Lloyd's k-means (squared L2), ``ceil(len / tokens_per_cluster)``
clusters per segment, initialised with the segment's keys at evenly spaced positions, ``iters``
rounds; an emptied cluster keeps its centroid and has size 0 (it is never retrieved or
estimated). Per cluster: centroid, size, sum of its values, and its member rows (rows sorted by
cluster, ``offsets`` delimiting each cluster's run).

Decode (per query head ``h``, KV head ``g = h // group``), scores ``s = q . x * scale``:
- steady zone: rows the caller names (sinks, recent and generated tokens), attended exactly;
- retrieval zone: the ``n_retrieve`` clusters of highest ``q . centroid`` (non-empty ones, ties to
  the lower id), their member tokens attended exactly;
- estimation zone: every other non-empty cluster ``c`` stands for its ``size_c`` tokens with key
  ``centroid_c`` and value ``value_sum_c / size_c``, i.e. adds ``size_c * exp(s_c)`` to the
  softmax denominator and ``exp(s_c) * value_sum_c`` to the numerator.
``out = (sum_exact e^s v + sum_est e^s_c vsum_c) / (sum_exact e^s + sum_est size_c e^s_c)``.
With ``n_retrieve`` = every cluster the estimation zone is empty and this is exact attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WaveIndex:
    """One request's index, per KV head ``g``: ``centroids[g]`` ``[C, d]`` (float32),
    ``sizes[g]`` ``[C]``, ``value_sums[g]`` ``[C, d]`` (float32), ``order[g]`` ``[n]`` the indexed
    rows sorted by cluster and ``offsets[g]`` ``[C + 1]`` (cluster c's rows are
    ``order[g, offsets[g, c]:offsets[g, c + 1]]``). Rows are indices into the k / v the index was
    built from."""

    centroids: torch.Tensor
    sizes: torch.Tensor
    value_sums: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor

    @property
    def num_clusters(self) -> int:
        return self.centroids.shape[1]


def per_head_sums(assign: torch.Tensor, x: torch.Tensor, n_clusters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x`` ``[H, n, d]`` with cluster ids ``assign`` ``[H, n]`` (``< n_clusters``, one id
    space per head): (row counts ``[H, C]`` int64, row sums ``[H, C, d]`` float32)."""
    h, _, d = x.shape
    ids = (assign + (torch.arange(h, device=x.device) * n_clusters).view(h, 1)).flatten()  # head h: h*C + c
    counts = torch.bincount(ids, minlength=h * n_clusters).view(h, n_clusters)
    sums = torch.zeros(h * n_clusters, d, device=x.device).index_add_(0, ids, x.reshape(-1, d).float())
    return counts, sums.view(h, n_clusters, d)


def kmeans(x: torch.Tensor, n_clusters: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's k-means of ``x`` ``[n, d]`` or, one problem per head, ``[H, n, d]`` (float32, any
    device), deterministic init at evenly spaced rows. Returns (assignment ``[n]`` / ``[H, n]``
    int64, centroids ``[C, d]`` / ``[H, C, d]``). Ties go to the lower cluster id."""
    flat = x.dim() == 2
    x = x.unsqueeze(0) if flat else x
    h, n, _ = x.shape
    init = torch.div(torch.arange(n_clusters, device=x.device) * n, n_clusters, rounding_mode="floor")
    centroids = x[:, init].clone()
    assign = torch.zeros(h, n, dtype=torch.int64, device=x.device)
    for _ in range(max(1, iters)):
        assign = torch.cdist(x, centroids).argmin(dim=2)  # argmin keeps the first of ties
        counts, sums = per_head_sums(assign, x, n_clusters)
        moved = counts > 0
        centroids[moved] = sums[moved] / counts[moved].unsqueeze(-1)
    return (assign[0], centroids[0]) if flat else (assign, centroids)


def build_wave_index(k: torch.Tensor, v: torch.Tensor, segment: int, tokens_per_cluster: int,
                     iters: int) -> WaveIndex:
    """Index rows ``[0, n)`` of k / v ``[n, H_kv, d]`` (see the module docstring), on their device
    (every KV head's k-means of one segment at once)."""
    n, hkv, d = k.shape
    kh, vh = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [H_kv, n, d]
    assign_parts, cent_parts, base = [], [], 0
    for start in range(0, n, segment):
        end = min(start + segment, n)
        c = -(-(end - start) // tokens_per_cluster)
        a, cen = kmeans(kh[:, start:end], c, iters)
        assign_parts.append(a + base)
        cent_parts.append(cen)
        base += c
    # the cluster count depends only on n and the segments, so every head has the same
    assign = torch.cat(assign_parts, dim=1)  # [H_kv, n]
    counts, vsums = per_head_sums(assign, vh, base)
    order = torch.sort(assign, dim=1, stable=True).indices  # rows by cluster, ascending within one
    offsets = torch.cat([counts.new_zeros(hkv, 1), counts.cumsum(1)], dim=1)
    return WaveIndex(torch.cat(cent_parts, dim=1), counts, vsums, order, offsets)


def retrieve_clusters(q: torch.Tensor, index: WaveIndex, n_retrieve: int) -> torch.Tensor:
    """Per query head ``q`` ``[H_q, d]``: the ``n_retrieve`` non-empty clusters of highest
    ``q . centroid`` (fewer if fewer exist), ascending ids, ``-1`` padded: ``[H_q, n_retrieve]``."""
    hq, group = q.shape[0], q.shape[0] // index.centroids.shape[0]
    out = torch.full((hq, n_retrieve), -1, dtype=torch.int64)
    for h in range(hq):
        g = h // group
        s = index.centroids[g] @ q[h].float()
        s[index.sizes[g] == 0] = float("-inf")
        ranked = torch.sort(-s, stable=True).indices
        take = ranked[: min(n_retrieve, int((index.sizes[g] > 0).sum()))]
        out[h, : take.numel()] = take.sort().values
    return out


def retro_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: WaveIndex,
                           steady: torch.Tensor, n_retrieve: int, scale: float | None = None) -> torch.Tensor:
    """q ``[H_q, d]``; k / v ``[n, H_kv, d]`` every row the index and ``steady`` refer to;
    ``steady`` rows attended exactly besides the retrieved clusters (disjoint from the indexed
    rows). Returns ``[H_q, d_v]`` float32 (see the module docstring)."""
    hq, d = q.shape
    group = hq // k.shape[1]
    scale = d ** -0.5 if scale is None else scale
    picked = retrieve_clusters(q, index, n_retrieve)
    out = torch.empty(hq, v.shape[-1])
    for h in range(hq):
        g = h // group
        clusters = picked[h][picked[h] >= 0]
        members = [index.order[g, index.offsets[g, c]: index.offsets[g, c + 1]] for c in clusters.tolist()]
        rows = torch.cat([steady.long(), *members]) if members else steady.long()
        s_exact = (k[rows, g].float() @ q[h].float()) * scale
        rest = index.sizes[g] > 0
        rest[clusters] = False
        s_est = (index.centroids[g, rest] @ q[h].float()) * scale
        m = torch.cat([s_exact, s_est]).max()
        w_exact, w_est = (s_exact - m).exp(), (s_est - m).exp()
        num = w_exact @ v[rows, g].float() + w_est @ index.value_sums[g, rest]
        den = w_exact.sum() + (w_est * index.sizes[g, rest].float()).sum()
        out[h] = num / den
    return out
