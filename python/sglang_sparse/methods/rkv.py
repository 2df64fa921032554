"""R-KV (Cai et al., 2025): importance minus redundancy, evicting back to a budget every
``interval`` decode tokens (made for long reasoning outputs).

At each eviction, per layer and KV head, over the request's n retained rows:

- importance: the mean softmax attention the *buffered queries* (the last ``window`` queries
  before the eviction) paid each row, averaged over the query heads of the KV head's GQA group,
  then max-pooled over neighbouring rows (odd ``kernel``, stride 1);
- redundancy: each key's cosine similarity to every other retained key of its head (self 0),
  averaged over the n rows, softmax over the rows (``eviction_scores.rkv_redundancy``: in O(n d)
  per head from the sum of the unit keys, no ``[n, n]`` fp32 matrix, 4 GB per KV head and layer
  after a 32K prompt; with it, R-KV's 32K prefill took 5.2 s on the H200 against dense's 3.4 s);
- score = ``alpha * importance - (1 - alpha) * redundancy``; the buffer's own rows
  ``[n - window, n)`` are always kept, of the rest the top ``budget - window`` (ties to the lower
  row). ``sgl_kernel_sparse.eviction_scores.rkv_select`` is the formula.

When: after the prompt's last chunk if its rows exceed ``budget`` (the buffer: the prompt's last
``window`` queries), then whenever decoding reaches ``budget + interval`` rows (the buffer: the
last ``window`` decode queries). A request holds ``budget`` to ``budget + interval`` rows.

The query buffer is kept as what it is used for, its accumulated attention: a query at row r
counts iff ``r >= E - window``, E the rows at which the next eviction fires (the prompt's rows at
its end when they exceed the budget, else ``budget + interval``); rows between evictions never
move, so this equals attending the buffered queries (causally) at eviction time. Stored per
slot (``core.slot_scores``), zeroed after each eviction; decode is tensor-only (``graph_decode``,
inside SGLang's decode CUDA graphs, attention by SGLang's own kernel over the retained rows).
A Chain Cache continuation resumes the slots with what they accumulated. Importance is the sum
over the buffer and the group divided by ``window * group`` (a buffer that got fewer queries,
e.g. a prompt shorter than the window, weighs less against redundancy).

Simplified from the R-KV reference code: its similarity threshold / "retain the last similar
token" refinement of the redundancy is not applied; softmax scale ``1/sqrt(d)``.

Parameters (R-KV's common settings): ``budget`` 1024 rows, ``window`` 8 buffered queries (also the
always-kept recent rows), ``interval`` 128 (must be >= window: the buffer lies between two
evictions), ``alpha`` 0.1, ``kernel`` 7.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse import rkv_redundancy_layers, rkv_redundancy_rows
from sgl_kernel_sparse.eviction_scores import rkv_select

from sglang_sparse.core.eviction import EvictingRuntime, KeptRows
from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.slot_scores import SlotScores
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class RKVConfig:
    budget: int = 1024
    window: int = 8
    interval: int = 128
    alpha: float = 0.1
    kernel: int = 7

    def validate(self) -> None:
        check_range("window", self.window, 1)
        check_range("budget", self.budget, self.window + 1)
        check_range("interval", self.interval, self.window)
        check_range("kernel", self.kernel, 1, 63)
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel={self.kernel} must be odd (pooling keeps rows centred)")
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"alpha={self.alpha} is out of range: must be in [0, 1], the weight of "
                              "importance against redundancy")


@register_method("rkv", "eviction", RKVConfig, "importance minus redundancy, periodic decode eviction")
class RKVRuntime(EvictingRuntime):
    graph_decode = True
    overlap_tested = True
    flat_kv_pool = True  # a wave's redundancy (every layer) and its moves in one launch each

    def __init__(self, cache, config: RKVConfig | None = None) -> None:
        self.config = config or RKVConfig()
        c = self.config
        super().__init__(cache, MemoryOracle.online(c.budget, c.interval))
        self.scores = SlotScores(cache.store, cache.kv_heads)  # the buffer's accumulated attention
        self.fire_at = c.budget + c.interval  # rows at which a decode eviction fires
        # decode evictions come in waves (requests that started together reach budget + interval
        # together), planned in batches of 64K rows on CUDA, 32K elsewhere (EvictingRuntime.wave_batch)
        self.plan_batch = self.wave_batch(self.fire_at)

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        c = self.config
        for i, r in enumerate(layer.step.requests):
            if r.rid not in self.cache.requests:
                continue
            fire = self.fire_at
            if r.is_prefill:  # rows at the prompt's end: evicted there when over the budget
                rows_end = r.row_start + r.prompt_len - r.logical_start
                fire = rows_end if rows_end > c.budget else fire
            q_rows = torch.arange(r.row_start, r.row_start + r.num_tokens)
            weights = (q_rows >= fire - c.window).float()
            self.scores.add_chunk(layer.layer_id, layer.request_tokens(i, layer.q),
                                  self.cache.resident_slots(r.rid), weights)

    def decode_view_tensors(self, batch: DecodeBatch) -> None:
        counts = batch.n_rows > self.fire_at - self.config.window  # this query's row >= E - window
        self.scores.add_decode(batch, self.fire_at, counts)
        return None

    def finish_step(self, step: StepInfo) -> None:
        self.schedule_over_budget(step, self.config.budget, self.config.interval)

    def plan(self, rid: str) -> KeptRows | None:
        return self.plan_many([rid])[0]

    def plan_many(self, rids: list[str]) -> list[KeptRows | None]:
        """Requests holding the same number of rows (a decode wave: every one at ``budget +
        interval``) are planned together, whatever their number in a constant number of
        operations: one read of their slots, one gather of their scores, the redundancy of every
        layer (``redundancy``) and one ``rkv_select`` over ``[R, layers, Hkv, n]``."""
        c = self.config
        plans: list[KeptRows | None] = [None] * len(rids)
        for n, idx in self.by_row_count(rids, c.budget).items():
            # [R, n]: row i of every layer and head of request r lives in slots[r, i]
            # (the scores live on the pool's device: SlotScores)
            slots = self.cache.resident_slots_many([rids[i] for i in idx]).to(self.scores.t.device)
            # [L, R, n, Hkv] -> [R, L, Hkv, n]: mean over the buffer and the group
            importance = self.scores.t[:, slots].permute(1, 0, 3, 2) / (c.window * self.scores.group)
            kept = rkv_select(importance, None, c.budget, c.window, c.alpha, c.kernel,
                              redundancy=self.redundancy(slots))  # [R, layers, Hkv, budget], ascending
            self.scores.clear(slots.flatten())  # the buffer starts over
            for j, i in enumerate(idx):
                plans[i] = KeptRows(kept[j])
            self.bump("evictions", len(idx))
            self.bump("rows_released", len(idx) * (n - c.budget))
        return plans

    def redundancy(self, slots: torch.Tensor) -> torch.Tensor:
        """``[R, layers, Hkv, n]`` for the rows at ``slots [R, n]``, read from the pool: over a flat
        pool every layer in one launch (``rkv_redundancy_layers``; on CUDA ``R x Hkv x layers``
        programs), else layer by layer (an fp8 pool stored as bytes, a layout SGLang does not
        allocate flat)."""
        store, flat = self.cache.store, self.cache.flat_pool()
        if flat is not None:
            return rkv_redundancy_layers(flat[0], slots.to(flat[0].device), store.num_layers)
        return torch.stack([rkv_redundancy_rows(store.k_buffer(layer), slots)
                            for layer in range(store.num_layers)], dim=1)
