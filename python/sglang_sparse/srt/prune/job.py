"""One pruning job between its plan and its apply (scheduler process)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# custom_params key that marks a generation request as a job's scoring probe
PROBE_KEY = "sglang_sparse_probe"


@dataclass
class Job:
    prune_id: str
    tokens: list
    namespace: tuple
    ranges: list
    policy: str
    keep: int
    positions: torch.Tensor  # retained logical positions inside the intervals (ascending)
    slots: torch.Tensor  # their KV slots
    probe_cap: int | None  # snapkv: the probe's prefix match stops here (the window is recomputed)
    scores: torch.Tensor = field(init=False)
    layers_seen: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.scores = torch.full((self.slots.numel(),), float("-inf"))
        self._sorted, self._order = torch.sort(self.slots)

    def index_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Index into ``self.slots`` of each given slot, -1 where it is not an interval slot."""
        if self.slots.numel() == 0:
            return torch.full_like(slots, -1)
        at = torch.searchsorted(self._sorted, slots).clamp(max=self.slots.numel() - 1)
        return torch.where(self._sorted[at] == slots, self._order[at], torch.full_like(slots, -1))
