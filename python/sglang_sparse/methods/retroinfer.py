"""RetroInfer (Chen et al., VLDB 2025): the KV cache as a vector store. A wave index (clusters of
keys) per layer and KV head, retrieval of the clusters nearest the query, and an estimate of the
attention mass of every other cluster; the KV payload lives in a host tier with a device cache of
clusters in front of it.

Mechanism, per request (numerics: ``sgl_kernel_sparse.retro``, the one definition):
- prefill is dense over the whole prompt, which stays resident while it is prefilled;
- at the safe point after the last prompt chunk (``plan``), the *cold* rows ``[sinks, L - local)``
  of the prompt (L rows) are indexed in every layer, on the device: per KV head, the rows are cut
  into segments of ``segment`` and each segment's keys clustered by k-means
  (``ceil(len / tokens_per_cluster)`` clusters, ``kmeans_iters`` rounds, every KV head at once);
  centroids, sizes and value sums stay on the device (in the KV cache's dtype, within
  ``index_mb``); the cold rows' K / V go to the host tier (``core/tiered_store.HostRows``), per
  head in cluster order, and their slots are released to the engine's allocator
  (``CacheManager.compact_tokens``: the kept rows ``[0, sinks)`` and ``[L - local, L)`` are the
  same tokens in every layer and head, so rows are re-pointed, nothing moves);
- each decode step, per layer (``attend``): for every indexed request the ``retrieve`` clusters of
  highest ``q . centroid`` per query head are picked on the device; one host sync reads the
  union over each KV head's query heads for every request; the device page cache
  (``core/tiered_store.PageCache``, the wave buffer: pages of ``page_rows`` rows, CLOCK
  replacement, misses copied from the host in one gather and one copy) returns their pages; then
  per request, every head at once (``tripartite``), the picked clusters' rows are attended
  exactly together with the *steady zone*, every resident row (sinks, the local window, every
  generated token, this one included); every other non-empty cluster adds ``size_c exp(s_c)`` to
  the softmax denominator and ``exp(s_c) value_sum_c`` to the numerator
  (``s_c = q . centroid_c * scale``). Attention gets a ``ComputedDecodeView``: the method computes
  the layer's output itself.

Index ranges: after the compaction a request's rows are ``[0, sinks)`` = logical ``[0, sinks)``,
``[sinks, sinks + local)`` = logical ``[L - local, L)``, then one row per generated token (logical
``L + t``); the RoPE offset ``L - sinks - local`` is the engine's (``engine/rows.py``). Host rows
are indexed by cold row ``j`` = logical ``sinks + j``, but attention never needs their positions
(keys are stored after RoPE). A prompt of at most ``sinks + local`` rows is not indexed: its
decode is exact attention over its rows, computed here too.

Memory: the engine's pool and the device tier count as device bytes (``payload_bytes``: page
cache capacity + the index budget ``index_mb``, used: pages in use + indexes; the MemoryOracle
prices ``sinks + local`` rows after the prompt plus one per token), the host tier separately
(``tier_stats``: ``/sparse/stats`` ``host_bytes_*``). When the host tier or the index budget is
full a request is not indexed (``retro_host_full`` / ``retro_index_full``) and decodes exactly
over its whole prompt, and SGLang's own memory checks apply to its rows.

Simplified from the paper (say so wherever results are quoted):
- generated tokens stay resident and are attended exactly; the paper also indexes them into the
  wave buffer as they accumulate;
- retrieval is per query head (a KV head fetches the union of its group's picks); the centroids
  are not refined during decoding;
- the page cache's control plane (lookup, CLOCK, copies) runs on the host between two halves of
  each layer, behind one device-to-host sync per layer; a miss is copied within the layer (a
  gather of the pinned host rows, then one copy), no prefetch across layers and no overlap with
  compute;
- decode runs Python per layer and request (``decode_needs_python``): eager only, the launcher
  adds ``--disable-cuda-graph`` on a GPU; the attention is torch ops, no Triton kernel. On the H200
  (8B shape) that decodes 4 resident 128K requests at 5.2 tok/s in all, where dense decodes its one
  at 61 (docs/measured.md);
- ``evicts_kv``: the radix cache is off (the launcher adds ``--disable-radix-cache``), and Chain
  Cache cannot carry the index or the host rows (``supports_chains = False``).
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np
import torch
from sgl_kernel_sparse.retro import build_wave_index

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.retention import all_positions
from sglang_sparse.core.tiered_store import Fetched, HostRows, PageCache, Pages
from sglang_sparse.core.views import ComputedDecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class RetroInferConfig:
    segment: int = 8192  # tokens per k-means segment
    tokens_per_cluster: int = 16  # average cluster size
    retrieve: int = 64  # clusters retrieved per query head (about retrieve * tokens_per_cluster tokens)
    sinks: int = 4  # first prompt rows kept resident (steady zone)
    local: int = 64  # last prompt rows kept resident (steady zone)
    cache_rows: int = 65536  # device page cache, rows (one token of one KV head and layer)
    page_rows: int = 8  # rows per device page (a cluster takes ceil(size / page_rows) pages)
    host_mb: int = 4096  # host tier capacity, MiB
    index_mb: int = 4096  # device memory for indexes (centroids, value sums, sizes), MiB
    kmeans_iters: int = 10

    def validate(self) -> None:
        check_range("segment", self.segment, 1)
        check_range("tokens_per_cluster", self.tokens_per_cluster, 1)
        if self.tokens_per_cluster > self.segment:
            raise ConfigError(f"tokens_per_cluster={self.tokens_per_cluster} must be at most segment={self.segment} "
                              "(a segment holds at least one cluster)")
        check_range("retrieve", self.retrieve, 1)
        check_range("sinks", self.sinks, 0)
        check_range("local", self.local, 1)
        check_range("cache_rows", self.cache_rows, 1)
        check_range("page_rows", self.page_rows, 1, 256)
        if self.page_rows > self.cache_rows:
            raise ConfigError(f"page_rows={self.page_rows} must be at most cache_rows={self.cache_rows} "
                              "(the device cache holds at least one page)")
        check_range("host_mb", self.host_mb, 1)
        check_range("index_mb", self.index_mb, 1)
        check_range("kmeans_iters", self.kmeans_iters, 1, 100)


@dataclass(frozen=True)
class LayerIndex:
    """One layer's clusters, on the device: ``centroids`` / ``value_sums`` ``[H_kv, C, d]`` in the
    KV cache's dtype (computed in float32), ``sizes`` ``[H_kv, C]`` int32."""

    centroids: torch.Tensor
    sizes: torch.Tensor
    value_sums: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.centroids.nbytes + self.sizes.nbytes + self.value_sums.nbytes


def select_clusters(q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor,
                    n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Retrieval zone: query heads ``q`` ``[G, d]`` sharing one KV head (``centroids`` ``[C, d]``,
    ``sizes`` ``[C]``), or ``[H_kv, G, d]`` over every KV head (``[H_kv, C, d]``, ``[H_kv, C]``).
    Returns the float32 scores ``q . centroid`` ``[..., G, C]`` (unscaled; the estimation zone
    reuses them) and the mask of the ``n`` non-empty clusters of highest score per query head
    (ties to the lower id; fewer when fewer are non-empty)."""
    scores = q.float() @ centroids.float().transpose(-1, -2)
    raw = scores.masked_fill(sizes.unsqueeze(-2) == 0, float("-inf"))
    ranked = torch.sort(-raw, dim=-1, stable=True).indices[..., : min(n, raw.shape[-1])]
    real = raw.gather(-1, ranked) > float("-inf")  # an empty cluster is never picked
    return scores, torch.zeros_like(raw, dtype=torch.bool).scatter_(-1, ranked, real)


def tripartite(q: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, index: LayerIndex | None,
               scores: torch.Tensor | None, picked: torch.Tensor | None, pages: Pages | None,
               scale: float) -> torch.Tensor:
    """One request's decode attention in one layer, every head at once. ``q`` ``[H_q, d]``;
    ``k_res`` / ``v_res`` ``[n, H_kv, d]`` the resident rows (steady zone, attended exactly);
    ``index`` the cold rows' clusters, ``scores`` / ``picked`` ``[H_kv, G, C]`` what
    :func:`select_clusters` returned for them, ``pages`` the picked clusters' rows (all None: no
    cold rows, exact attention). A page's
    rows count for query head ``h`` only if ``h`` picked the page's cluster (a KV head's pages
    are the union over its group). Returns ``[H_q, d_v]`` float32."""
    hq, d = q.shape
    hkv = k_res.shape[1]
    qg = q.view(hkv, hq // hkv, d).float()
    s_res = torch.einsum("hgd,nhd->hgn", qg, k_res.float()) * scale  # [H_kv, G, n]
    m = s_res.amax(dim=2, keepdim=True)
    if index is not None:
        rows = pages.k.shape[2]
        s_u = torch.einsum("hgd,hpd->hgp", qg, pages.k.float().flatten(1, 2)) * scale  # [H_kv, G, P * rows]
        own = picked.gather(2, pages.cluster.unsqueeze(1).expand(-1, qg.shape[1], -1))  # [H_kv, G, P]
        live = torch.arange(rows, device=q.device) < pages.length.unsqueeze(-1)  # [H_kv, P, rows]
        keep = own.unsqueeze(-1) & live.unsqueeze(1)
        s_u = s_u.masked_fill(~keep.flatten(2), float("-inf"))
        est = ~picked & (index.sizes > 0).unsqueeze(1)  # estimation zone
        s_c = (scores * scale).masked_fill(~est, float("-inf"))
        m = torch.maximum(m, torch.maximum(s_u.amax(2, keepdim=True), s_c.amax(2, keepdim=True)))
    w_res = (s_res - m).exp()
    num = torch.einsum("hgn,nhd->hgd", w_res, v_res.float())
    den = w_res.sum(2)
    if index is not None:
        w_u, w_c = (s_u - m).exp(), (s_c - m).exp()
        num = num + torch.einsum("hgp,hpd->hgd", w_u, pages.v.float().flatten(1, 2)) + w_c @ index.value_sums.float()
        den = den + w_u.sum(2) + (w_c * index.sizes.unsqueeze(1).float()).sum(2)
    return (num / den.unsqueeze(-1)).reshape(hq, -1)


def index_nbytes(c: RetroInferConfig, n_cold: int, layers: int, kv_heads: int, d_k: int, d_v: int,
                 itemsize: int) -> int:
    """Device bytes of the index over ``n_cold`` rows (``build_wave_index``'s cluster count): per
    layer, KV head and cluster a centroid and a value sum in the cache's dtype and an int32 size."""
    clusters = sum(-(-min(c.segment, n_cold - s) // c.tokens_per_cluster) for s in range(0, n_cold, c.segment))
    return layers * kv_heads * clusters * ((d_k + d_v) * itemsize + 4)


@register_method("retroinfer", "dynamic selection", RetroInferConfig,
                 "wave index of key clusters, retrieval + estimation, cold KV in a host tier behind a device cache")
class RetroInferRuntime(EvictingRuntime):
    supports_chains = False  # a chain would have to carry the index and the host rows

    def __init__(self, cache, config: RetroInferConfig | None = None) -> None:
        self.config = config or RetroInferConfig()
        c = self.config
        super().__init__(cache, MemoryOracle(retained_budget=c.sinks + c.local))
        k0, v0 = cache.store.k_buffer(0), cache.store.v_buffer(0)
        self.device = k0.device
        self.host = HostRows(self.device, c.host_mb * 2 ** 20)
        self.tiers = PageCache(self.host, self.device, c.cache_rows, k0.shape[-1], v0.shape[-1], k0.dtype,
                               c.page_rows)
        self.indexes: dict[str, list[LayerIndex]] = {}  # rid -> one LayerIndex per layer
        self.index_bytes = 0

    # -- memory ------------------------------------------------------------------------------
    def payload_bytes(self) -> tuple[int, int]:
        """Device bytes besides the engine's pool: the page cache (capacity, pages in use) and the
        index budget (``index_mb``; used: the indexes of every indexed request)."""
        return self.tiers.bytes_total + self.config.index_mb * 2 ** 20, self.tiers.bytes_used + self.index_bytes

    def tier_stats(self) -> dict:
        return {"host_bytes_total": self.host.capacity_bytes, "host_bytes_used": self.host.bytes_used,
                "host_bytes_peak": self.host.bytes_peak, "host_requests": self.host.requests(),
                "index_bytes": self.index_bytes, "index_bytes_total": self.config.index_mb * 2 ** 20,
                "device_cache": self.tiers.stats()}

    # -- lifecycle ---------------------------------------------------------------------------
    def on_request_end(self, rid: str) -> None:
        layers = self.indexes.pop(rid, None)
        if layers is not None:
            self.index_bytes -= sum(x.nbytes for x in layers)
        self.host.drop(rid)
        self.tiers.drop(rid)

    def kept_positions(self, retained, metadata: dict) -> list[torch.Tensor]:
        """Every position: the cold rows ``[sinks, L - local)`` live in the host tier (attended
        through the index), the rest stays resident."""
        return all_positions(retained)

    def finish_step(self, step: StepInfo) -> None:
        kept = self.config.sinks + self.config.local
        for r in step.requests:
            state = self.cache.requests.get(r.rid)
            if state is not None and r.is_last_prompt_chunk and state.retained.n_rows > kept:
                self.schedule(r.rid)

    def plan(self, rid: str) -> torch.Tensor | None:
        """Index the cold rows ``[sinks, n - local)`` in every layer, move their K / V to the host
        tier and keep rows ``[0, sinks)`` and ``[n - local, n)`` (logical positions, 1-D)."""
        c, store = self.config, self.cache.store
        ret = self.cache.requests[rid].retained
        n, held = ret.n_rows, ret.token_positions()
        if rid in self.indexes or n <= c.sinks + c.local or held is None:
            return None
        cold = self.cache.resident_slots(rid)[c.sinks: n - c.local]  # slots of cold rows, row order
        k0 = store.k_buffer(0)
        if not self.host.fits(store.num_layers * 2 * cold.numel() * k0.shape[1] * k0.shape[2] * k0.element_size()):
            self.bump("retro_host_full")
            return None
        if self.index_bytes + self.index_nbytes(cold.numel()) > c.index_mb * 2 ** 20:
            self.bump("retro_index_full")
            return None
        layers = []
        for layer in range(store.num_layers):
            k, v = store.k_buffer(layer)[cold], store.v_buffer(layer)[cold]  # [n_cold, H_kv, d], on the device
            idx = build_wave_index(k, v, c.segment, c.tokens_per_cluster, c.kmeans_iters)
            # per head, rows in cluster order: cluster j of head g = [offsets[g, j], offsets[g, j+1])
            ks = k.transpose(0, 1).gather(1, idx.order.unsqueeze(-1).expand(-1, -1, k.shape[-1]))
            vs = v.transpose(0, 1).gather(1, idx.order.unsqueeze(-1).expand(-1, -1, v.shape[-1]))
            self.host.put(rid, layer, ks, vs, idx.offsets)
            self.tiers.register(rid, layer, idx.sizes)
            # the index in the cache's dtype (bf16 on the GPU: 1/16 of the clusters' KV bytes)
            layers.append(LayerIndex(idx.centroids.to(k.dtype), idx.sizes.to(torch.int32), idx.value_sums.to(k.dtype)))
        self.indexes[rid] = layers
        self.index_bytes += sum(x.nbytes for x in layers)
        self.bump("retro_indexed_requests")
        self.bump("retro_rows_offloaded", int(cold.numel()))
        self.bump("retro_clusters", int(layers[0].sizes.numel()) * store.num_layers)
        return torch.cat([held[: c.sinks], held[n - c.local:]])

    def index_nbytes(self, n_cold: int) -> int:
        store = self.cache.store
        k0, v0 = store.k_buffer(0), store.v_buffer(0)
        return index_nbytes(self.config, n_cold, store.num_layers, k0.shape[1], k0.shape[-1], v0.shape[-1],
                            k0.element_size())

    # -- decode (eager: batched over heads, one host sync per layer) ----------------------------
    def build_decode_selection(self, layer: LayerInput) -> ComputedDecodeView:
        return ComputedDecodeView(lambda scale: self.attend(layer, scale))

    def attend(self, layer: LayerInput, scale: float) -> torch.Tensor:
        """``[B, H_q, d_v]``: every decode request of the step, in step order. Retrieval runs on
        the device for every indexed request, then one host sync reads all their picked clusters
        (the union over each KV head's query heads) for the page cache's lookup."""
        store, lid = self.cache.store, layer.layer_id
        reqs = layer.step.requests
        qs = [layer.request_tokens(i, layer.q)[0] for i in range(len(reqs))]
        scores: dict[int, torch.Tensor] = {}
        picked: dict[int, torch.Tensor] = {}
        for i, r in enumerate(reqs):
            if r.rid in self.indexes:
                ix = self.indexes[r.rid][lid]
                qg = qs[i].view(ix.centroids.shape[0], -1, qs[i].shape[-1])
                scores[i], picked[i] = select_clusters(qg, ix.centroids, ix.sizes, self.config.retrieve)  # [H_kv, G, C]
        fetched = self._fetch(lid, reqs, picked)
        outs = []
        for i, r in enumerate(reqs):
            slots = store.row_slots(r.req_row, 0, r.row_start + r.num_tokens)  # resident rows, this one incl.
            index = self.indexes[r.rid][lid] if i in picked else None
            pages = self.tiers.gather(fetched[i], index.sizes.shape[0]) if index is not None else None
            outs.append(tripartite(qs[i], store.k_buffer(lid)[slots], store.v_buffer(lid)[slots], index,
                                   scores.get(i), picked.get(i), pages, scale))
        return torch.stack(outs)

    def _fetch(self, lid: int, reqs, picked: dict[int, torch.Tensor]) -> dict[int, Fetched]:
        """Each indexed request's union of picked clusters per KV head, through the page cache."""
        if not picked:
            return {}
        unions = [picked[i].any(dim=1).flatten() for i in picked]  # [H_kv * C] per request
        chosen = torch.cat(unions).nonzero().flatten().cpu().numpy()  # the one host sync of the layer
        bounds = np.cumsum([0] + [u.numel() for u in unions])
        parts = np.split(chosen, np.searchsorted(chosen, bounds[1:-1]))  # sorted: one run per request
        out = {}
        for n, i in enumerate(picked):
            local = parts[n] - bounds[n]
            c = picked[i].shape[-1]
            out[i] = self.tiers.fetch(reqs[i].rid, lid, local // c, local % c)  # by head, then cluster
        return out
