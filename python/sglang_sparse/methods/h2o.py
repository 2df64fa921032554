"""H2O (Zhang et al., NeurIPS 2023): heavy hitters by accumulated attention + a recent window,
evicting online while decoding.

Score of a retained row j (per layer and KV head): the sum of the softmax attention every query
so far paid it, ``hh[h, j] = sum_i sum_{q-head in group(h)} A_{ij}`` (fp32, causal; GQA: summed
over the query heads of the KV head's group, so the choice is per KV head and frees physical
rows). Every prompt query counts (each chunk's queries over the rows resident then: the whole
prompt, which is held until its last chunk), then every decode query. When a request's rows
exceed ``budget``: rows ``[n - recent, n)`` are kept, and of rows ``[0, n - recent)`` the
``budget - recent`` highest scores (ties to the lower row, i.e. the older token;
``sgl_kernel_sparse.eviction_scores.h2o_select``). Kept rows keep their scores and go on
accumulating.

When: after the prompt's last chunk (if it exceeds ``budget``), then while decoding whenever
``interval`` rows have accumulated past ``budget``: a request holds ``budget`` to
``budget + interval`` rows. The paper evicts one token per step (``interval=1``: a compaction,
i.e. a KV move in every layer, per decode step); the default 32 amortises it, so heavy hitters
are chosen among up to ``interval`` more candidates than the paper's.

Not done: eviction between prompt chunks. SGLang's chunked request is not at a safe point
between its chunks (its row offset is fixed at its first extend), so the prompt is held whole
and scored by all its queries, as the paper does with an unchunked prompt; peak rows = prompt.

State: per-slot scores (``core.slot_scores``), so decode is tensor-only (``graph_decode``): each
decode layer adds its queries' attention (``token_logits`` over the first ``budget + interval``
columns of the slot table) into the persistent tensor, inside SGLang's decode CUDA graphs, and
returns no view: attention is SGLang's own dense kernel over the retained rows. Prefill chunks
score eagerly (``on_prefill_chunk``): each chunk's softmax attention over the request's rows is
recomputed in plain torch, fp32 (``eviction_scores.attention_sums``, no fused kernel yet), an
O(chunk x rows) pass per layer next to SGLang's own prefill attention. Scores move with their rows at compaction and stay with a
parked chain's slots, so a Chain Cache continuation goes on from them.

Parameters: ``budget`` rows kept per layer and KV head (heavy hitters + recent; the paper's
setting is about 10% + 10% of the sequence), ``recent`` the recent window (default: half the
budget), ``interval`` eviction slack while decoding. Scores use ``1/sqrt(d)`` as the softmax
scale (the model's own scale is not part of a layer's input; equal for Llama / Qwen shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse.eviction_scores import h2o_select

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.slot_scores import SlotScores
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class H2OConfig:
    budget: int = 1024
    recent: int = 512
    interval: int = 32

    def validate(self) -> None:
        check_range("recent", self.recent, 1)
        if self.budget <= self.recent:  # at least one heavy hitter
            raise ConfigError(f"budget={self.budget} is out of range: must be > recent={self.recent} (the "
                              "heavy hitters are budget - recent; lower --sparse-recent with the budget)")
        check_range("interval", self.interval, 1)


@register_method("h2o", "eviction", H2OConfig, "heavy hitters (accumulated attention) + recent window, online")
class H2ORuntime(EvictingRuntime):
    graph_decode = True

    def __init__(self, cache, config: H2OConfig | None = None) -> None:
        self.config = config or H2OConfig()
        c = self.config
        super().__init__(cache, MemoryOracle(retained_budget=c.budget, row_cap=c.budget + c.interval))
        self.scores = SlotScores(cache.store, cache.kv_heads)

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        """Every request of a prefill or mixed step: its queries' attention over its rows."""
        for i, r in enumerate(layer.step.requests):
            if r.rid in self.cache.requests:
                self.scores.add_chunk(layer.layer_id, layer.request_tokens(i, layer.q),
                                      self.cache.resident_slots(r.rid))

    def decode_view_tensors(self, batch: DecodeBatch) -> None:
        # rows never exceed budget + interval at a decode step (evicted at every safe point)
        self.scores.add_decode(batch, self.config.budget + self.config.interval)
        return None

    def finish_step(self, step: StepInfo) -> None:
        self.schedule_over_budget(step, self.config.budget, self.config.interval)

    def plan(self, rid: str) -> torch.Tensor | None:
        ret = self.cache.requests[rid].retained
        if ret.n_rows <= self.config.budget:
            return None
        slots = self.cache.resident_slots(rid)  # [n]: row i of every layer and head lives in slots[i]
        scores = self.scores.rows(slots)  # [layers, Hkv, n]
        rows = h2o_select(scores, self.config.budget, self.config.recent)  # [layers, Hkv, budget]
        self.scores.put(slots, scores.gather(2, rows))  # kept rows' scores go where their KV goes
        self.bump("evictions")
        self.bump("rows_released", ret.n_rows - self.config.budget)
        return ret.all_positions().gather(2, rows.cpu())  # logical positions, ascending per head
