"""SnapKV (Li et al., NeurIPS 2024): prompt KV chosen once by observation-window attention,
then physically compacted.

After the last prompt chunk, the last ``window`` prompt queries score every earlier prompt
position (softmax attention, fp32, summed over the window, averaged over each GQA group so the
choice is per KV head), scores are avg-pooled (``kernel``), and per layer and KV head the top
``budget - window`` positions plus the window are kept (``sgl_kernel_sparse.reference.snapkv_keep_indices``,
the window scores on Triton for CUDA tensors; ties go to the lower position). Everything else is released to the allocator. Prompts of at most
``budget`` tokens are not compressed; decode tokens are appended and never rescored.

Chunked prefill: window queries are buffered as their chunk passes, so a window that straddles
chunks, or a one-chunk prefill, give the same selection. Scoring reads the resident prompt keys
at the safe point, so no prompt-length score buffer is kept between chunks.

Parameters: ``budget`` C (tokens kept per layer and KV head, window included), ``window`` w,
``kernel`` pooling width (odd; 1 disables pooling), ``sinks`` and ``recent`` (0: off, the
published SnapKV): the first ``sinks`` and the last ``max(recent, w)`` prompt rows are always kept,
inside the budget (the paper's comparisons use 64 and 512), the rest of the budget goes to the top
pooled scores between them. Pooling is unchanged (a forced row's raw score still smooths its
neighbours'). On a resumed chain these count the rows the prompt holds: the first ``sinks`` rows
are the earliest retained positions (the chain's own sinks when it kept them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse.reference import SNAPKV_KERNEL, SNAPKV_WINDOW

from sglang_sparse.core.events import LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.kernels import snapkv_keep_indices
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class SnapKVConfig:
    budget: int = 1024
    window: int = SNAPKV_WINDOW
    kernel: int = SNAPKV_KERNEL
    sinks: int = 0
    recent: int = 0

    def validate(self) -> None:
        check_range("window", self.window, 1)
        check_range("budget", self.budget, self.window + 1)
        check_range("kernel", self.kernel, 1, 63)
        if self.kernel % 2 == 0:
            raise ConfigError(f"kernel={self.kernel} must be odd (pooling keeps positions centred)")
        check_range("sinks", self.sinks, 0)
        check_range("recent", self.recent, 0)
        forced = self.sinks + max(self.recent, self.window)
        if forced > self.budget:
            raise ConfigError(f"sinks={self.sinks} plus recent={max(self.recent, self.window)} (at least the "
                              f"window) is {forced} positions, more than budget={self.budget}: the always-kept "
                              "positions must fit inside the budget")


@register_method("snapkv", "eviction", SnapKVConfig, "observation-window prompt selection + compaction")
class SnapKVRuntime(EvictingRuntime):
    def __init__(self, cache, config: SnapKVConfig | None = None) -> None:
        self.config = config or SnapKVConfig()
        super().__init__(cache, MemoryOracle(retained_budget=self.config.budget))

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        """Buffer the queries of logical positions ``[P - w, P)`` as their chunk passes."""
        for i, r in enumerate(layer.step.requests):
            if not r.is_prefill or r.prompt_len <= self.config.budget:
                continue
            w = self.config.window
            lo, hi = max(r.logical_start, r.prompt_len - w), min(r.logical_end, r.prompt_len)
            if lo >= hi:
                continue
            meta = self.cache.requests[r.rid].metadata
            q = layer.request_tokens(i, layer.q)
            buf = meta.setdefault("window_q", {}).get(layer.layer_id)
            if buf is None:
                buf = q.new_zeros(w, *q.shape[1:])
                meta["window_q"][layer.layer_id] = buf
            win_lo = lo - (r.prompt_len - w)
            buf[win_lo : win_lo + (hi - lo)] = q[lo - r.logical_start : hi - r.logical_start]

    def finish_step(self, step: StepInfo) -> None:
        for r in step.requests:
            if r.is_last_prompt_chunk and r.prompt_len > self.config.budget:
                self.schedule(r.rid)

    def plan(self, rid: str) -> torch.Tensor:
        state = self.cache.requests[rid]
        prompt, ret = state.prompt_len, state.retained
        window_q = state.metadata.pop("window_q")
        keep = []
        held = ret.all_positions()  # [layers, kv_heads, rows]: logical position of each row
        prompt_rows = prompt - ret.offset  # rows holding prompt tokens (a resumed chain: fewer)
        slots = self.cache.resident_slots(rid)[:prompt_rows]  # the prompt's keys stay in the pool
        for layer in range(self.cache.store.num_layers):
            picked = snapkv_keep_indices(
                window_q[layer], self.cache.store.k_buffer(layer), self.config.budget, self.config.window,
                self.config.kernel, slots=slots.to(window_q[layer].device),
                sinks=self.config.sinks, recent=self.config.recent,
            )  # row indices per KV head (== logical positions unless the request resumed a chain)
            keep.append(held[layer].gather(1, picked.cpu()))
        keep_t = torch.stack(keep)  # [layers, kv_heads, budget]
        decoded = ret.logical_len - prompt  # tokens decoded before the safe point: kept
        if decoded:
            tail = torch.arange(prompt, ret.logical_len).expand(*keep_t.shape[:2], decoded)
            keep_t = torch.cat([keep_t, tail], dim=2)
        return keep_t
