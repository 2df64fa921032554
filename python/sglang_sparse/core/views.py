"""AttentionView: exactly what attention reads in one layer, for one step (engine-agnostic).

Persistent KV stays with the CacheManager; a view only names rows (see ``events`` for the
row / logical convention). ``None`` from a hook means "dense": every resident row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class DecodeView:
    """Rows each query head of each request reads in a decode step.

    ``rows[i]`` is ``[H_q, n_i]`` int64 row indices for request i (ascending per head);
    ``valid[i]`` is the same shape, False where a head reads fewer rows than ``n_i`` (padding).
    """

    rows: tuple[torch.Tensor, ...]
    valid: tuple[torch.Tensor, ...]

    def rows_read(self) -> int:
        return int(sum(v.sum() for v in self.valid))


@dataclass(frozen=True)
class PagedDecodeView:
    """Whole pages each query head reads, as batched tensors (graph-safe; see ``DecodeBatch``).

    ``page_ids`` ``[B, H_q, n]`` int: row-page indices (page ``p`` = rows ``[p*page_size,
    (p+1)*page_size)`` of the request's slot table), ``-1`` = padding; rows ``>= n_rows[b]`` (a
    partial last page) are not read. ``aligned``: the method promises that each row-page is one
    whole, aligned pool page (the engine allocates KV in pages of ``page_size``, as for Quest), so
    a kernel may read one slot-table entry per page and add the offset inside it. ``per_kv_head``:
    ``page_ids`` is ``[B, H_kv, n]``, one page set per KV head read by all its query heads (Quest
    ``--sparse-select-per kv_head``), so a kernel loads each page once for the whole group.
    """

    page_ids: torch.Tensor
    page_size: int
    n_rows: torch.Tensor
    aligned: bool = False
    per_kv_head: bool = False


@dataclass(frozen=True)
class RowsTailDecodeView:
    """Chosen rows plus a contiguous tail, as batched tensors (graph-safe; OmniKV): request b
    reads rows ``sel_rows[b]`` (``[B, N]``, ``-1`` = padding, all ``< tail_start[b]``, the same
    for every query head) and then every row of ``[tail_start[b], n_rows[b])``."""

    sel_rows: torch.Tensor
    tail_start: torch.Tensor
    n_rows: torch.Tensor


@dataclass(frozen=True)
class BlockSparsePrefillView:
    """A prefill or mixed step under a sparse prefill policy (``--sparse-prefill``): where
    ``sparse[i]``, request i's chunk (logical positions ``[row_start, row_start + s)``, the same
    numbers as its rows: only requests whose rows are their positions get here) attends its
    resident rows ``[0, row_start)`` and itself through ``attend(q, k, v, start, scale)`` (q
    ``[s, Hq, D]``, k / v ``[start + s, Hkv, D]`` in position order -> ``[s, Hq, Dv]``); the
    other requests go through the backend's dense kernel."""

    sparse: tuple[bool, ...]
    attend: Callable


@dataclass(frozen=True)
class LayerRowsView:
    """Per-layer row tables (``RetainedMap`` per-layer form) in a prefill or mixed step: where
    each request's rows of one layer live. ``cells[i]`` are flat cells of the store
    (``KVStore.flat_kv``) of the rows *before* the chunk, in row order, which the chunk then
    attends plus itself causally; None where the engine's own slot table is right (a request
    without a per-layer map). Decode steps read ``CellsDecodeView`` instead."""

    cells: tuple[torch.Tensor | None, ...]


@dataclass(frozen=True)
class PrefixKVView:
    """A prefill or mixed step where some request's history lies outside the engine's slot table
    (``SparseMethodRuntime.prefix_kv``: a resumed KIVI chain's quantized blocks, dequantized):
    ``prefix[i] = (k, v)`` ``[n, H_kv, d]``, logical positions ``[0, n)``, which request i's chunk
    attends before its resident rows; None where the slot table is the whole history."""

    prefix: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]


@dataclass(frozen=True)
class QuantizedDecodeView:
    """A quantized history (``core/quant_store``): request i reads its ``n_blocks[i]`` blocks
    (``block_table`` row = its engine row, like the slot table) and then its resident
    full-precision rows ``[0, n_rows)`` of the engine's slot table (this token included)."""

    store: Any  # QuantizedBlockStore
    block_table: torch.Tensor
    n_blocks: torch.Tensor


@dataclass(frozen=True)
class CellsDecodeView:
    """Graph-safe decode over per-layer row tables (``core/cell_tables``): in layer ``layer``
    each request reads its packed rows and then the rows appended since (its slot table from
    ``packed_rows``), as flat cells of the store (``KVStore.flat_kv``)."""

    tables: Any  # CellTables
    layer: int


@dataclass(frozen=True)
class ComputedDecodeView:
    """A decode layer whose output the method computes itself (RetroInfer: exact attention over
    retrieved clusters fetched from its own tiers plus an estimate of the rest, which no row list
    can express). ``attend(scale)`` returns the layer's attention output ``[B, H_q, d_v]`` for the
    step's requests in step order, ``scale`` being the layer's softmax scale. Eager only: the
    method runs Python per layer (``decode_needs_python``)."""

    attend: Callable[[float], torch.Tensor]
