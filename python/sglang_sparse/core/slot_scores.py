"""SlotScores: an accumulated attention score per physical KV slot, layer and KV head
(engine-agnostic), the persistent state of online eviction methods (H2O, R-KV).

```
 scores[layer, slot, h]   fp32, [num_layers, num_slots, kv_heads], on the pool's device
 a request's row i of KV head h lives in slot slots[i]  ->  its score is scores[:, slots[i], h]
```

Scores are indexed by slot, not by request, so that (1) a CUDA-graph decode step updates them
with tensor ops only (the batch's slot table says where each row lives), (2) they stay with the
KV when a request parks its rows in a chain and a continuation resumes them (same slots), and
(3) a compaction moves them with the rows (``put``): row i of head h moves to slot ``slots[i]``
exactly as ``CacheManager.compact`` moves its KV. A slot's first write (a new token) zeroes its
score, so whatever an earlier owner left there never counts.

Memory: ``4 * num_layers * num_slots * kv_heads`` bytes besides the pool (SmolLM2, 65,536 slots:
24 MB; a 36-layer, 8-KV-head model with 500K slots: 576 MB), not part of the engine's own sizing.
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse import attention_sums, decode_attention_add

from sglang_sparse.core.events import DecodeBatch, LayerInput


class SlotScores:
    def __init__(self, store, kv_heads: int) -> None:
        self.store = store
        k0 = store.k_buffer(0)
        self.t = torch.zeros(store.num_layers, k0.shape[0], kv_heads, dtype=torch.float32, device=k0.device)
        self.group = 1  # query heads per KV head (GQA), known from the first queries

    def add_chunk(self, layer: int, q: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Eager (prefill and mixed steps): a request's ``T`` queries ``q [T, Hq, d]`` of this
        step, whose rows are the last T of its resident ``slots [n]`` (row order), add their
        causal attention over rows ``[0, n)``, summed over each KV head's query heads
        (optionally weighted per query)."""
        n, t = slots.numel(), q.shape[0]
        self.group = q.shape[1] // self.t.shape[2]
        scores = self.t[layer]
        scores[slots[n - t:]] = 0.0  # new rows start at zero
        rows = torch.arange(n - t, n, device=q.device)  # rows of this step's queries
        if weights is not None:  # only the queries that count (R-KV: its buffer)
            counted = weights.to(q.device) != 0
            if not bool(counted.any()):
                return
            q, rows, weights = q[counted], rows[counted], weights.to(q.device)[counted]
        keys = self.store.k_buffer(layer)[slots]
        # rows are in [0, n) by construction: the kernel skips its range check (a read back to the host)
        scores.index_add_(0, slots, attention_sums(q, keys, rows, weights=weights, check_rows_range=False).T)

    def add_decode(self, batch: DecodeBatch, width: int, weight: torch.Tensor | None = None) -> None:
        """Tensor-only (captured into CUDA graphs): each decode query adds its attention over its
        request's rows ``[0, n_rows)``, read through the first ``width`` columns of the slot table
        (the method guarantees ``n_rows <= width`` at a decode step). Padding entries of a
        captured batch write slot 0 (SGLang's dummy slot, never a token's): they add nothing.
        ``weight [B]`` scales each query's contribution (R-KV counts only its buffer)."""
        table = batch.table[:, : min(width, batch.table.shape[1])]
        self.group = batch.q.shape[1] // self.t.shape[2]
        decode_attention_add(self.t[batch.layer_id], batch.q, batch.k_cache, table, batch.req_rows, batch.n_rows,
                             batch.slots, weight)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Scores of a request's rows ``[0, n)`` in row order: ``[layers, Hkv, n]`` (a copy)."""
        return self.t[:, slots.to(self.t.device)].permute(0, 2, 1).contiguous()

    def put(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """After choosing ``values [layers, Hkv, B]`` for the kept rows: row i of every head goes
        to ``slots[i]`` (where the compaction moves its KV)."""
        b = values.shape[2]
        self.t[:, slots[:b].to(self.t.device)] = values.permute(0, 2, 1).to(self.t.device)

    def clear(self, slots: torch.Tensor) -> None:
        self.t[:, slots.to(self.t.device)] = 0.0


class AccumulatedAttentionHooks:
    """The prefill and decode hooks of a method that keeps each row's accumulated attention from
    every query (H2O, SkipKV) in ``self.scores`` (a SlotScores) and never holds more than
    ``config.budget + config.interval`` rows at a decode step (it evicts at every safe point)."""

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        """Every request of a prefill or mixed step: its queries' attention over its rows."""
        for i, r in enumerate(layer.step.requests):
            if r.rid in self.cache.requests:
                self.scores.add_chunk(layer.layer_id, layer.request_tokens(i, layer.q),
                                      self.cache.resident_slots(r.rid))

    def decode_view_tensors(self, batch: DecodeBatch) -> None:
        self.scores.add_decode(batch, self.config.budget + self.config.interval)
        return None
