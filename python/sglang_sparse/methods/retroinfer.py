"""RetroInfer (Chen et al., VLDB 2025): the KV cache as a vector store. A wave index (clusters of
keys) per layer and KV head, retrieval of the clusters nearest the query, and an estimate of the
attention mass of every other cluster; the KV payload lives in a host tier with a device cache of
clusters in front of it.

Mechanism, per request (numerics: ``sgl_kernel_sparse.retro``, the one definition):
- prefill is dense over the whole prompt, which stays resident while it is prefilled;
- at the safe point after the last prompt chunk (``plan``), the *cold* rows ``[sinks, L - local)``
  of the prompt (L rows) are indexed in every layer: per KV head, the rows are cut into segments
  of ``segment`` and each segment's keys clustered by k-means (``ceil(len / tokens_per_cluster)``
  clusters, ``kmeans_iters`` rounds); centroids, sizes and value sums stay on the device; the cold
  rows' K / V go to the host tier (``core/tiered_store.HostRows``), per head in cluster order, and
  their slots are released to the engine's allocator (``CacheManager.compact_tokens``: the kept
  rows ``[0, sinks)`` and ``[L - local, L)`` are the same tokens in every layer and head, so rows
  are re-pointed, nothing moves);
- each decode step, per layer, request and query head (``tripartite``): the ``retrieve`` clusters
  of highest ``q . centroid`` are fetched through the device LRU cache
  (``core/tiered_store.ClusterCache``, misses copied from the host) and attended exactly together
  with the *steady zone*, every resident row (sinks, the local window, every generated token,
  this one included); every other non-empty cluster adds ``size_c exp(s_c)`` to the softmax
  denominator and ``exp(s_c) value_sum_c`` to the numerator (``s_c = q . centroid_c * scale``).
  Attention gets a ``ComputedDecodeView``: the method computes the layer's output itself.

Index ranges: after the compaction a request's rows are ``[0, sinks)`` = logical ``[0, sinks)``,
``[sinks, sinks + local)`` = logical ``[L - local, L)``, then one row per generated token (logical
``L + t``); the RoPE offset ``L - sinks - local`` is the engine's (``engine/rows.py``). Host rows
are indexed by cold row ``j`` = logical ``sinks + j``, but attention never needs their positions
(keys are stored after RoPE). A prompt of at most ``sinks + local`` rows is not indexed: its
decode is exact attention over its rows, computed here too.

Memory: the engine's pool and the device tier count as device bytes (``payload_bytes``: cache
capacity + index; the MemoryOracle prices ``sinks + local`` rows after the prompt plus one per
token), the host tier separately (``tier_stats``: ``/sparse/stats`` ``host_bytes_*``). When the
host tier is full a request is not indexed (``retro_host_full``) and decodes exactly over its
whole prompt, and SGLang's own memory checks apply to its rows.

Simplified from the paper (say so wherever results are quoted):
- generated tokens stay resident and are attended exactly; the paper also indexes them into the
  wave buffer as they accumulate;
- the index is built on the host (CPU k-means over the cold rows, copied off the device) instead
  of the paper's GPU k-means, and the centroids are not refined during decoding;
- the device cache is an LRU of clusters with separately allocated tensors (the paper's wave
  buffer: a preallocated block cache with its own replacement and a CPU-side control plane); a
  miss copies synchronously from the host (pinned memory, ``non_blocking``) within the layer, no
  prefetch across layers;
- decode runs Python per layer and request (``decode_needs_python``): eager only, the launcher
  adds ``--disable-cuda-graph`` on a GPU; no Triton kernel. The GPU path has not been run on a GPU;
- ``evicts_kv``: the radix cache is off (the launcher adds ``--disable-radix-cache``), and Chain
  Cache cannot carry the index or the host rows (``supports_chains = False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from sgl_kernel_sparse.retro import build_wave_index

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.retention import all_positions
from sglang_sparse.core.tiered_store import ClusterCache, HostRows
from sglang_sparse.core.views import ComputedDecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class RetroInferConfig:
    segment: int = 8192  # tokens per k-means segment
    tokens_per_cluster: int = 16  # average cluster size
    retrieve: int = 64  # clusters retrieved per query head (about retrieve * tokens_per_cluster tokens)
    sinks: int = 4  # first prompt rows kept resident (steady zone)
    local: int = 64  # last prompt rows kept resident (steady zone)
    cache_rows: int = 65536  # device cluster cache, rows (one token of one KV head and layer)
    host_mb: int = 4096  # host tier capacity, MiB
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
        check_range("host_mb", self.host_mb, 1)
        check_range("kmeans_iters", self.kmeans_iters, 1, 100)


@dataclass(frozen=True)
class LayerIndex:
    """One layer's clusters, on the device: ``centroids`` / ``value_sums`` ``[H_kv, C, d]`` float32,
    ``sizes`` ``[H_kv, C]`` int64."""

    centroids: torch.Tensor
    sizes: torch.Tensor
    value_sums: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.centroids.nbytes + self.sizes.nbytes + self.value_sums.nbytes


def select_clusters(q: torch.Tensor, centroids: torch.Tensor, sizes: torch.Tensor, n: int) -> torch.Tensor:
    """Retrieval zone of query heads ``q`` ``[G, d]`` sharing one KV head: a ``[G, C]`` mask of the
    ``n`` non-empty clusters of highest ``q . centroid`` per head (ties to the lower id; fewer when
    fewer are non-empty)."""
    raw = q.float() @ centroids.T
    raw = raw.masked_fill(sizes.view(1, -1) == 0, float("-inf"))
    take = min(n, int((sizes > 0).sum()))
    ranked = torch.sort(-raw, dim=1, stable=True).indices[:, :take]
    return torch.zeros_like(raw, dtype=torch.bool).scatter_(1, ranked, True)


def tripartite(q: torch.Tensor, k_res: torch.Tensor, v_res: torch.Tensor, index: LayerIndex | None,
               fetch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], n_retrieve: int,
               scale: float) -> torch.Tensor:
    """One request's decode attention in one layer. ``q`` ``[H_q, d]``; ``k_res`` / ``v_res``
    ``[n, H_kv, d]`` the resident rows (steady zone, attended exactly); ``index`` the cold rows'
    clusters (None: no cold rows, exact attention); ``fetch(head, cluster)`` a cluster's K / V
    ``[size, d]``. Returns ``[H_q, d_v]`` float32."""
    hq, hkv = q.shape[0], k_res.shape[1]
    group = hq // hkv
    out = torch.empty(hq, v_res.shape[-1], dtype=torch.float32, device=q.device)
    for g in range(hkv):
        qg = q[g * group: (g + 1) * group].float()  # the query heads of KV head g
        s_res = (qg @ k_res[:, g].float().T) * scale  # [G, n]
        num = den = None
        if index is None:
            m = s_res.amax(dim=1, keepdim=True)
        else:
            cent, sizes, vsum = index.centroids[g], index.sizes[g], index.value_sums[g]
            picked = select_clusters(qg, cent, sizes, n_retrieve)  # [G, C]
            union = picked.any(dim=0).nonzero().flatten().tolist()  # fetched once for the group
            parts = [fetch(g, c) for c in union]
            k_u = torch.cat([p[0] for p in parts]).float() if parts else qg.new_zeros(0, qg.shape[1])
            v_u = torch.cat([p[1] for p in parts]).float() if parts else qg.new_zeros(0, v_res.shape[-1])
            cid = torch.cat([torch.full((p[0].shape[0],), c, device=q.device) for c, p in zip(union, parts)]) \
                if parts else torch.zeros(0, dtype=torch.int64, device=q.device)
            s_u = ((qg @ k_u.T) * scale).masked_fill(~picked[:, cid], float("-inf"))  # own clusters only
            est = (~picked) & (sizes > 0).view(1, -1)  # estimation zone
            s_c = ((qg @ cent.T) * scale).masked_fill(~est, float("-inf"))
            m = torch.cat([s_res, s_u, s_c], dim=1).amax(dim=1, keepdim=True)
            w_u, w_c = (s_u - m).exp(), (s_c - m).exp()
            num = w_u @ v_u + w_c @ vsum
            den = w_u.sum(1) + (w_c * sizes.float()).sum(1)
        w_res = (s_res - m).exp()
        n_res, d_res = w_res @ v_res[:, g].float(), w_res.sum(1)
        if num is not None:
            n_res, d_res = n_res + num, d_res + den
        out[g * group: (g + 1) * group] = n_res / d_res.view(-1, 1)
    return out


@register_method("retroinfer", "dynamic selection", RetroInferConfig,
                 "wave index of key clusters, retrieval + estimation, cold KV in a host tier behind a device cache")
class RetroInferRuntime(EvictingRuntime):
    supports_chains = False  # a chain would have to carry the index and the host rows

    def __init__(self, cache, config: RetroInferConfig | None = None) -> None:
        self.config = config or RetroInferConfig()
        c = self.config
        super().__init__(cache, MemoryOracle(retained_budget=c.sinks + c.local))
        k0 = cache.store.k_buffer(0)
        self.device = k0.device
        self.host = HostRows(self.device, c.host_mb * 2 ** 20)
        self.tiers = ClusterCache(self.host, self.device, c.cache_rows, 2 * k0.shape[-1] * k0.element_size())
        self.indexes: dict[str, list[LayerIndex]] = {}  # rid -> one LayerIndex per layer
        self.index_bytes = 0

    # -- memory ------------------------------------------------------------------------------
    def payload_bytes(self) -> tuple[int, int]:
        """Device bytes besides the engine's pool: the cluster cache (capacity, used) and the
        index (centroids, sizes, value sums) of every indexed request."""
        return self.tiers.bytes_total + self.index_bytes, self.tiers.bytes_used + self.index_bytes

    def tier_stats(self) -> dict:
        return {"host_bytes_total": self.host.capacity_bytes, "host_bytes_used": self.host.bytes_used,
                "host_bytes_peak": self.host.bytes_peak, "host_requests": self.host.requests(),
                "index_bytes": self.index_bytes, "device_cache": self.tiers.stats()}

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
        layers = []
        for layer in range(store.num_layers):
            k, v = store.k_buffer(layer)[cold].cpu(), store.v_buffer(layer)[cold].cpu()  # [n_cold, H_kv, d]
            idx = build_wave_index(k, v, c.segment, c.tokens_per_cluster, c.kmeans_iters)
            heads = range(k.shape[1])
            # per head, rows in cluster order: cluster j of head g = [offsets[g, j], offsets[g, j+1])
            self.host.put(rid, layer, torch.stack([k[idx.order[g], g] for g in heads]),
                          torch.stack([v[idx.order[g], g] for g in heads]), idx.offsets)
            layers.append(LayerIndex(idx.centroids.to(self.device), idx.sizes.to(self.device),
                                     idx.value_sums.to(self.device)))
        self.indexes[rid] = layers
        self.index_bytes += sum(x.nbytes for x in layers)
        self.bump("retro_indexed_requests")
        self.bump("retro_rows_offloaded", int(cold.numel()))
        self.bump("retro_clusters", int(layers[0].sizes.numel()) * store.num_layers)
        return torch.cat([held[: c.sinks], held[n - c.local:]])

    # -- decode (eager: Python per layer and request) ------------------------------------------
    def build_decode_selection(self, layer: LayerInput) -> ComputedDecodeView:
        return ComputedDecodeView(lambda scale: self.attend(layer, scale))

    def attend(self, layer: LayerInput, scale: float) -> torch.Tensor:
        """``[B, H_q, d_v]``: every decode request of the step, in step order."""
        store, lid, outs = self.cache.store, layer.layer_id, []
        for i, r in enumerate(layer.step.requests):
            slots = store.row_slots(r.req_row, 0, r.row_start + r.num_tokens)  # resident rows, this one incl.
            index = self.indexes.get(r.rid, [None] * (lid + 1))[lid]
            fetch = (lambda g, c, rid=r.rid: self.tiers.get(rid, lid, g, c))
            q = layer.request_tokens(i, layer.q)[0]
            outs.append(tripartite(q, store.k_buffer(lid)[slots], store.v_buffer(lid)[slots], index, fetch,
                                   self.config.retrieve, scale))
        return torch.stack(outs)
