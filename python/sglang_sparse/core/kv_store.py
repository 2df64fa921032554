"""The engine's KV storage as a cache manager sees it (engine-agnostic).

A *slot* holds one token's K and V in every layer: ``k_buffer(layer)[slot]`` is ``[H_kv, d]``.
A request owns a row of a slot table: ``row_slots(req_row, start, end)`` are the slots of its
rows ``[start, end)``. The SGLang adapter implements ``KVStore`` over SGLang's KV pool,
``req_to_token`` and allocator; ``TensorKVStore`` is a plain-torch implementation with the same
semantics for tests and engine-free use.

Flat cells (methods with per-layer rows, ``RetainedMap`` per-layer form): a store may keep every
layer's K in one tensor, ``flat_kv()[0]`` ``[num_layers * slots_per_layer, H_kv, d]``, with layer
l's buffer the rows ``[l * slots_per_layer, (l + 1) * slots_per_layer)``. A *cell* is one row of
it: ``cell(layer, slot) = layer * slots_per_layer + slot``. A layer's kept rows may then live in
cells of another layer's part, which is how per-layer budgets free whole slots (docs/kv_payload.md).
"""

from __future__ import annotations

from typing import Protocol

import torch
from sgl_kernel_sparse.reference import compact_kv


class KVStore(Protocol):
    num_layers: int

    def k_buffer(self, layer: int) -> torch.Tensor:
        """``[num_slots, H_kv, d]``; writes through it change the stored KV."""

    def v_buffer(self, layer: int) -> torch.Tensor: ...

    def row_slots(self, req_row: int, start: int, end: int) -> torch.Tensor:
        """int64 slots of rows ``[start, end)`` of a request. Valid until the rows change."""

    def rows_slots(self, req_rows: torch.Tensor, n: int) -> torch.Tensor:
        """``[R, n]`` int64: the slots of rows ``[0, n)`` of several requests (``req_rows [R]``),
        in one read of the slot table."""

    def free_slots(self, slots: torch.Tensor) -> None:
        """Return slots to the allocator. Each slot must be freed exactly once."""

    def free_count(self) -> int: ...

    def move_kv(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """In layer ``layer``: ``buf[dst[i], h] = buf[src[h, i], h]`` for K and V (``src [H_kv, n]``,
        ``dst [n]`` distinct), every source read before any write."""

    def truncate_rows(self, req_row: int, n_rows: int) -> None:
        """The request now owns only rows ``[0, n_rows)``; the caller frees the others' slots."""

    def set_row_slots(self, req_row: int, slots: torch.Tensor) -> None:
        """Rows ``[0, len(slots))`` of a request now point at ``slots`` (a token-uniform
        compaction re-points rows instead of moving KV)."""

    def bytes_per_slot(self) -> int:
        """Bytes one slot takes in the store's representation (K and V of every layer)."""

    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every layer as ``[num_layers * slots_per_layer, H_kv, d]`` views (stores
        built for per-layer rows; others raise)."""

    def cells(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Flat cells of ``slots`` in ``layer``."""

    def table_shape(self) -> tuple[int, int]:
        """``(request rows, max rows per request)`` of the engine's slot table."""

    def payload_budget_bytes(self) -> int | None:
        """Bytes of the engine's pool given to a method's own store (``pool_split``); None: the
        engine kept them all."""


class TensorKVStore:
    """Slot pool + slot table + free list, all plain tensors. KV is allocated in pages of
    ``page_size`` slots, filled in order by their owner (SGLang's paged allocator): page ``j``
    is slots ``[j*page_size, (j+1)*page_size)``. Page 0 holds the padding slot 0, as in SGLang,
    and is never handed out. With ``page_size`` 1 a page is a slot."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int,
                 max_rows: int = 8, max_len: int = 4096, dtype=torch.float32, page_size: int = 1) -> None:
        self.num_layers = num_layers
        self.page_size = page_size
        pages = num_slots // page_size
        self.k = torch.zeros(num_layers, (pages + 1) * page_size, kv_heads, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.table = torch.zeros(max_rows, max_len, dtype=torch.int64)
        self.lengths = [0] * max_rows  # rows in use per request row
        self._free = list(range(pages, 0, -1))  # free pages; pop() hands out 1, 2, 3, ...
        self._is_free = torch.zeros(pages + 1, dtype=torch.bool)
        self._is_free[1:] = True

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.k[layer]

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.v[layer]

    def row_slots(self, req_row: int, start: int, end: int) -> torch.Tensor:
        return self.table[req_row, start:end]

    def rows_slots(self, req_rows: torch.Tensor, n: int) -> torch.Tensor:
        return self.table[req_rows.to(self.table.device), :n]

    def free_count(self) -> int:
        return len(self._free) * self.page_size

    def bytes_per_slot(self) -> int:
        return self.k[:, 0].nbytes + self.v[:, 0].nbytes

    def alloc_rows(self, req_row: int, n: int) -> torch.Tensor:
        """Append n rows to a request (the engine's job in SGLang): the rest of its last page
        first, then fresh pages."""
        p, start = self.page_size, self.lengths[req_row]
        in_last = (-start) % p  # free rows left in the request's last page
        if n - in_last > len(self._free) * p:
            raise MemoryError(f"asked for {n} slots, {len(self._free) * p} free")
        slots = []
        if in_last:
            last = int(self.table[req_row, start - 1])
            slots += range(last + 1, last + 1 + min(in_last, n))
        while len(slots) < n:
            page = self._free.pop()
            self._is_free[page] = False
            slots += range(page * p, page * p + min(p, n - len(slots)))
        out = torch.tensor(slots, dtype=torch.int64)
        self.table[req_row, start : start + n] = out
        self.lengths[req_row] = start + n
        return out

    def move_kv(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        compact_kv(self.k[layer], self.v[layer], src, dst)

    def table_shape(self) -> tuple[int, int]:
        return tuple(self.table.shape)

    def payload_budget_bytes(self) -> int | None:
        return None

    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.view(-1, *self.k.shape[2:]), self.v.view(-1, *self.v.shape[2:])

    def cells(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return layer * self.k.shape[1] + slots.to(torch.int64)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

    def free_slots(self, slots: torch.Tensor) -> None:
        """Free whole pages (with ``page_size`` 1: any slots)."""
        pages = slots // self.page_size
        if self.page_size > 1 and len(slots) != len(set(pages.tolist())) * self.page_size:
            raise RuntimeError(f"slots {slots.tolist()} are not whole pages of {self.page_size}")
        pages = sorted(set(pages.tolist()))
        if bool(self._is_free[pages].any()) or (self.page_size == 1 and len(pages) != len(slots)):
            raise RuntimeError(f"double free of slots {slots.tolist()}")
        self._is_free[pages] = True
        self._free.extend(pages)

    def truncate_rows(self, req_row: int, n_rows: int) -> None:
        """The request now owns only rows ``[0, n_rows)`` (after a compaction freed the rest)."""
        self.lengths[req_row] = n_rows

    def set_row_slots(self, req_row: int, slots: torch.Tensor) -> None:
        self.table[req_row, : len(slots)] = slots.to(self.table.dtype)

    def release_row(self, req_row: int) -> None:
        """Request finished: free every page it still owns (what SGLang does on release)."""
        n = self.lengths[req_row]
        if n:
            pages = (self.table[req_row, :n] // self.page_size).unique()
            self.free_slots((pages.view(-1, 1) * self.page_size + torch.arange(self.page_size)).flatten())
        self.lengths[req_row] = 0
