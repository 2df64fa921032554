"""The engine's KV storage as a cache manager sees it (engine-agnostic).

A *slot* holds one token's K and V in every layer: ``k_buffer(layer)[slot]`` is ``[H_kv, d]``.
A request owns a row of a slot table: ``row_slots(req_row, start, end)`` are the slots of its
rows ``[start, end)``. The SGLang adapter implements ``KVStore`` over SGLang's KV pool,
``req_to_token`` and allocator; ``TensorKVStore`` is a plain-torch implementation with the same
semantics for tests and engine-free use.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KVStore(Protocol):
    num_layers: int

    def k_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, H_kv, d]``; writes through it change the stored KV."""

    def v_buffer(self, layer: int) -> torch.Tensor: ...

    def row_slots(self, req_row: int, start: int, end: int) -> torch.Tensor:
        """int64 slots of rows ``[start, end)`` of a request. Valid until the rows change."""

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return slots to the allocator. Each slot must be freed exactly once."""

    def free_count(self) -> int: ...

    def truncate_rows(self, req_row: int, n_rows: int) -> None:
        """The request now owns only rows ``[0, n_rows)``; the caller frees the others' slots."""


class TensorKVStore:
    """Slot pool + slot table + free list, all plain tensors. Slot 0 is a padding sink, as in
    SGLang, and is never handed out."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 max_rows: int = 8, max_len: int = 4096, dtype=torch.float32) -> None:
        self.num_layers = num_layers
        self.k = torch.zeros(num_layers, num_slots + 1, kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.table = torch.zeros(max_rows, max_len, dtype=torch.int64)
        self.lengths = [0] * max_rows  # rows in use per request row
        self._free = list(range(num_slots, 0, -1))  # pop() hands out 1, 2, 3, ...
        self._is_free = torch.zeros(num_slots + 1, dtype=torch.bool)
        self._is_free[1:] = True

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def row_slots(self, req_row: int, start: int, end: int) -> torch.Tensor:
        return self.table[req_row, start:end]

    def free_count(self) -> int:
        return len(self._free)

    def alloc_rows(self, req_row: int, n: int) -> torch.Tensor:
        """Append n rows to a request (the engine's job in SGLang)."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} slots, {len(self._free)} free")
        slots = torch.tensor([self._free.pop() for _ in range(n)], dtype=torch.int64)
        self._is_free[slots] = False
        start = self.lengths[req_row]
        self.table[req_row, start : start + n] = slots
        self.lengths[req_row] = start + n
        return slots

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

    def free_slots(self, slots: torch.Tensor) -> None:
        if bool(self._is_free[slots].any()) or len(set(slots.tolist())) != len(slots):
            raise RuntimeError(f"double free of slots {slots.tolist()}")
        self._is_free[slots] = True
        self._free.extend(slots.tolist())

    def truncate_rows(self, req_row: int, n_rows: int) -> None:
        """The request now owns only rows ``[0, n_rows)`` (after a compaction freed the rest)."""
        self.lengths[req_row] = n_rows

    def release_row(self, req_row: int) -> None:
        """Request finished: free every slot it still owns (what SGLang does on release)."""
        n = self.lengths[req_row]
        if n:
            self.free_slots(self.table[req_row, :n].clone())
        self.lengths[req_row] = 0
