"""H2O (Zhang et al., NeurIPS 2023): heavy hitters by accumulated attention + a recent window,
evicting online between prompt chunks and while decoding.

Score of a retained row j (per layer and KV head): the sum of the softmax attention every query
so far paid it, ``hh[h, j] = sum_i sum_{q-head in group(h)} A_{ij}`` (fp32, causal; GQA: summed
over the query heads of the KV head's group, so the choice is per KV head and frees physical
rows). Every prompt query counts (each chunk's queries over the rows resident then, see When),
then every decode query. When a request's rows
exceed ``budget``: rows ``[n - recent, n)`` are kept, and of rows ``[0, n - recent)`` the
``budget - recent`` highest scores (ties to the lower row, i.e. the older token;
``sgl_kernel_sparse.eviction_scores.h2o_select``). Kept rows keep their scores and go on
accumulating.

When (``evict_prefill=on``, the default): whenever a step leaves a request ``interval`` or more
rows past ``budget`` -- a prompt chunk or a decode token -- and after the prompt's last chunk if
it exceeds ``budget`` at all. A prompt chunk's queries attend the rows retained then (the kept
heavy hitters + recent rows of the earlier chunks, at their logical RoPE positions) plus the
chunk's own, so a long prompt holds at most ``budget + interval - 1 + chunk`` rows (peak) instead
of the whole prompt, and each chunk's scoring pass is O(chunk x (budget + interval + chunk)) per
layer instead of O(chunk x prompt). The paper scores an unchunked prompt by all its queries; with
chunked prefill and ``evict_prefill=on`` a row evicted after chunk c is not seen (and cannot be
rescued) by later chunks' queries: the paper's greedy online eviction (each step keeps the best
rows among those it holds) applied at chunk granularity to the prompt too (so the kept set
depends on the chunk size; ``eviction_scores.h2o_simulate`` with
``evict_prefill=True`` is the reference, in the engine's order). ``evict_prefill=off``: the prompt
is held whole until its last chunk, then evicted to ``budget`` (peak rows = prompt; the kept set
does not depend on the chunk size). Between chunks the engine compacts at its safe point (after
a chunk's results are processed, before the next chunk is scheduled): the request keeps its
``req_to_token`` row, the freed slots go back to SGLang's allocator, the next chunk's prefix
length is the retained rows and its positions are logical (``srt/engine/steps.compact_chunked``,
``rows.follow_chunk_compaction``).
Admission counts ``min(rest of prompt, budget + interval + chunk)`` rows for a prompt to be
prefilled (``MemoryOracle.prefill_cap``); SGLang's tokenizer still refuses a prompt longer than
the pool. The trigger is the decode one (``over >= interval``, ``EvictingRuntime.
schedule_over_budget``) so prompt and decode evict alike, and a Chain Cache continuation's
suffix is evicted between its chunks the same way, after the resumed rows.

While decoding, a request holds ``budget`` to ``budget + interval`` rows. The paper evicts one
token per step (``interval=1``: a compaction, i.e. a KV move in every layer, per decode step);
the default 32 amortises it, so heavy hitters are chosen among up to ``interval`` more
candidates than the paper's.

State: per-slot scores (``core.slot_scores``), so decode is tensor-only (``graph_decode``): each
decode layer adds its queries' attention (``token_logits`` over the first ``budget + interval``
columns of the slot table) into the persistent tensor, inside SGLang's decode CUDA graphs, and
returns no view: attention is SGLang's own dense kernel over the retained rows. Prefill chunks
score eagerly (``on_prefill_chunk``): each chunk's softmax attention over the request's rows is
recomputed next to SGLang's own prefill attention, an O(chunk x rows) pass per layer
(``sgl_kernel_sparse.attention_sums``: on CUDA a two-pass flash-style Triton kernel,
``triton_attn_sums``, that never holds the chunk x rows matrix; elsewhere the plain-torch fp32
reference ``eviction_scores.attention_sums``). Scores move with their rows at compaction and stay with a
parked chain's slots, so a Chain Cache continuation goes on from them.

Parameters: ``budget`` rows kept per layer and KV head (heavy hitters + recent; the paper's
setting is about 10% + 10% of the sequence), ``recent`` the recent window (default: half the
budget), ``interval`` eviction slack (decode and prompt chunks), ``evict_prefill`` on|off
(evict between prompt chunks; default on, since holding a 32K prompt whole is what H2O is meant
to avoid and scoring it whole is an O(prompt^2) pass per layer). Scores use ``1/sqrt(d)`` as the softmax
scale (the model's own scale is not part of a layer's input; equal for Llama / Qwen shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

from sgl_kernel_sparse.eviction_scores import h2o_select

from sglang_sparse.core.eviction import EvictingRuntime, KeptRows
from sglang_sparse.core.events import StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.slot_scores import AccumulatedAttentionHooks, SlotScores
from sglang_sparse.registry import ConfigError, check_evict_prefill, check_range, register_method


@dataclass(frozen=True)
class H2OConfig:
    budget: int = 1024
    recent: int = 512
    interval: int = 32
    evict_prefill: str = "on"  # "on" | "off": also evict between prompt chunks

    def validate(self) -> None:
        check_evict_prefill(self.evict_prefill)
        check_range("recent", self.recent, 1)
        if self.budget <= self.recent:  # at least one heavy hitter
            raise ConfigError(f"budget={self.budget} is out of range: must be > recent={self.recent} (the "
                              "heavy hitters are budget - recent; lower --sparse-recent with the budget)")
        check_range("interval", self.interval, 1)


@register_method("h2o", "eviction", H2OConfig, "heavy hitters (accumulated attention) + recent window, online")
class H2ORuntime(AccumulatedAttentionHooks, EvictingRuntime):
    graph_decode = True
    overlap_tested = True
    flat_kv_pool = True  # a wave's moves over every layer in one launch (CacheManager.compact_rows_many)

    def __init__(self, cache, config: H2OConfig | None = None) -> None:
        self.config = config or H2OConfig()
        c = self.config
        self.evict_prefill = c.evict_prefill == "on"
        # while prefilling, at most budget + interval - 1 rows before a chunk (cap: budget + interval)
        super().__init__(cache, MemoryOracle.online(c.budget, c.interval, self.evict_prefill))
        self.scores = SlotScores(cache.store, cache.kv_heads)
        self.plan_batch = self.wave_batch(c.budget + c.interval)  # a decode wave planned together

    def finish_step(self, step: StepInfo) -> None:
        self.schedule_over_budget(step, self.config.budget, self.config.interval, during_prefill=self.evict_prefill)

    def plan(self, rid: str) -> KeptRows | None:
        return self.plan_many([rid])[0]

    def plan_many(self, rids: list[str]) -> list[KeptRows | None]:
        """Requests holding the same number of rows (a decode wave: every one at ``budget +
        interval``) are planned together: one gather of their scores, one ``h2o_select``."""
        c = self.config
        plans: list[KeptRows | None] = [None] * len(rids)
        for n, idx in self.by_row_count(rids, c.budget).items():
            # [R, n]: row i of every layer and head of request r lives in slots[r, i]
            slots = self.cache.resident_slots_many([rids[i] for i in idx]).to(self.scores.t.device)
            scores = self.scores.rows(slots.flatten()).unflatten(2, (len(idx), n)).permute(2, 0, 1, 3)  # [R, L, Hkv, n]
            rows = h2o_select(scores, c.budget, c.recent)  # [R, layers, Hkv, budget]
            # kept rows' scores go where their KV goes: row i of request r to slots[r, i]
            self.scores.put(slots[:, : c.budget].flatten(),
                            scores.gather(3, rows).permute(1, 2, 0, 3).flatten(2))
            for j, i in enumerate(idx):
                plans[i] = KeptRows(rows[j])  # rows (ascending per head), not positions: no search back
            self.bump("evictions", len(idx))
            self.bump("rows_released", len(idx) * (n - c.budget))
        return plans
