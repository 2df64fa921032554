"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks + a recent window, evicting while decoding.

Kept per request: the first ``sinks`` logical tokens and the last ``recent`` ones, in every layer
and KV head; everything between is released to the allocator.

Granularity (the paper evicts one token per step): eviction runs at the engine's safe point
between steps, once ``evict_every`` tokens have accumulated past ``sinks + recent``. A request
therefore holds between ``sinks + recent`` and ``sinks + recent + evict_every`` rows, and attention
reads a recent window of ``recent`` to ``recent + evict_every - 1`` tokens. ``evict_every=1`` is the
paper's step granularity (one compaction per decode step); the default 16 amortises the per-eviction
bookkeeping. An eviction moves no KV: the kept tokens are the same in every layer and head, so the
plan is 1-D and ``CacheManager.compact_tokens`` re-points the kept rows at their slots and frees
the others (``docs/kv_payload.md``).

The prompt is held whole while it is prefilled (chunks attend to all of it) and cut to sinks +
recent after its last chunk, like SnapKV. Chain Cache resumes a chain from its sinks + window.

No re-rotation: keys are stored after RoPE at their original logical positions, and new tokens
take their logical position (not their position inside the cache, as the paper's re-rotating
variant does). So relative distances between a query and the sinks grow without bound; models
trained with a long enough context (SmolLM2: 8K) read them fine within it. Beyond the model's
context the re-rotating variant would be needed; it is not offered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.registry import check_range, register_method


@dataclass(frozen=True)
class StreamingLLMConfig:
    sinks: int = 4
    recent: int = 512
    evict_every: int = 16

    def validate(self) -> None:
        check_range("sinks", self.sinks, 0)
        check_range("recent", self.recent, 1)
        check_range("evict_every", self.evict_every, 1)

    @property
    def kept(self) -> int:
        return self.sinks + self.recent


def streaming_keep(positions: torch.Tensor, sinks: int, recent: int) -> torch.Tensor:
    """The rows' logical positions ``[..., n]`` (ascending) cut to the first ``sinks`` and the
    last ``recent`` entries."""
    n = positions.shape[-1]
    if n <= sinks + recent:
        return positions
    return torch.cat([positions[..., :sinks], positions[..., n - recent:]], dim=-1)


@register_method("streamingllm", "eviction", StreamingLLMConfig, "attention sinks + recent window, evicting while decoding")
class StreamingLLMRuntime(EvictingRuntime):
    def __init__(self, cache, config: StreamingLLMConfig | None = None) -> None:
        self.config = config or StreamingLLMConfig()
        c = self.config
        super().__init__(cache, MemoryOracle(retained_budget=c.kept, row_cap=c.kept + c.evict_every))

    def finish_step(self, step: StepInfo) -> None:
        self.schedule_over_budget(step, self.config.kept, self.config.evict_every)

    def plan(self, rid: str) -> torch.Tensor | None:
        ret = self.cache.requests[rid].retained
        if ret.n_rows <= self.config.kept:
            return None
        held = ret.token_positions()  # [rows]: every layer and head keeps the same tokens
        if held is None:  # not reachable for StreamingLLM's own maps; a per-head map still works
            held = ret.all_positions()
        return streaming_keep(held, self.config.sinks, self.config.recent)
