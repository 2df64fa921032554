"""Decode attention over the views of one batch: one ``sgl_kernel_sparse`` call (Triton on CUDA,
its plain-torch reference elsewhere: the CPU path).

- ``decode_over_views``: per-request ``DecodeView`` rows (eager Python hooks);
- ``decode_over_pages``: a batched ``PagedDecodeView`` (graph-safe hooks);
- ``decode_over_cells``: a ``CellsDecodeView``, per-layer row tables (graph-safe hooks);
- ``decode_over_rows_tail``: a ``RowsTailDecodeView``, chosen rows + a contiguous tail (graph-safe).

Index ranges: ``rows[i]`` ``[Hq, n_i]`` are row indices of request i's ``req_to_token`` row (for
methods that do not evict, row == logical position); ``valid[i]`` masks padding. Slots are looked
up as ``req_to_token[req_row, row]``.
"""

from __future__ import annotations

import torch

import sgl_kernel_sparse


def pad_views(rows: list[torch.Tensor], valid: list[torch.Tensor], row_limit: list[int]):
    """Stack per-request ``[Hq, n_i]`` views into ``[B, Hq, N]`` (N = max n_i), padding with row 0
    marked invalid; rows past ``row_limit[i] - 1`` (never valid) are clamped so lookups stay in
    bounds."""
    n = max(r.shape[-1] for r in rows)
    b, hq = len(rows), rows[0].shape[0]
    out_rows = torch.zeros(b, hq, n, dtype=torch.int64, device=rows[0].device)
    out_valid = torch.zeros(b, hq, n, dtype=torch.bool, device=rows[0].device)
    for i, (r, v) in enumerate(zip(rows, valid)):
        out_rows[i, :, : r.shape[-1]] = r.clamp(max=row_limit[i] - 1)
        out_valid[i, :, : v.shape[-1]] = v
    return out_rows, out_valid


def decode_over_views(q, k_cache, v_cache, req_to_token, req_rows: list[int], rows: list[torch.Tensor],
                      valid: list[torch.Tensor], row_limit: list[int], scale: float) -> torch.Tensor:
    """q ``[B, Hq, D]``; k/v_cache ``[slots, Hkv, D]``. Returns ``[B, Hq, Dv]`` in q's dtype."""
    r, v = pad_views(rows, valid, row_limit)
    req = torch.tensor(req_rows, dtype=torch.int64, device=q.device)
    return sgl_kernel_sparse.sparse_decode_attention(q, k_cache, v_cache, req_to_token, req, r, v, scale)


def decode_over_pages(q, k_cache, v_cache, table, req_rows, page_ids, n_rows, page: int, scale: float,
                      aligned: bool = False, per_kv_head: bool = False):
    """q ``[B, Hq, D]``; page_ids ``[B, Hq, P]`` row-pages (``-1`` padding); rows ``>= n_rows[b]``
    masked. ``aligned``: each row-page is one whole pool page (``PagedDecodeView.aligned``), so
    the Triton kernel reads one slot-table entry per page. The kernel package dispatches itself
    (Triton on CUDA, no host sync, so CUDA graphs capture it; its plain-torch reference
    elsewhere, which reads every row's slot either way). ``per_kv_head``: page_ids ``[B, Hkv, P]``
    (``PagedDecodeView.per_kv_head``), read by the GQA kernel (each page once per group)."""
    if per_kv_head and page_ids.shape[1] != q.shape[1]:  # (one query head per KV head: the same rows)
        return sgl_kernel_sparse.paged_gqa_decode_attention(
            q, k_cache, v_cache, table, req_rows.long(), page_ids, n_rows, page, scale, aligned=aligned)
    return sgl_kernel_sparse.paged_sparse_decode_attention(
        q, k_cache, v_cache, table, req_rows.long(), page_ids, n_rows, page, scale, aligned=aligned)


def decode_over_cells(q, flat_k, flat_v, table, req_rows, n_rows, tables, layer: int, scale: float):
    """q ``[B, Hq, D]``; ``tables`` a ``core.cell_tables.CellTables``; ``n_rows [B]`` resident engine
    rows incl. this token; flat_k / flat_v every layer's pool as one ``[layers * slots, Hkv, D]``.
    No host sync on CUDA (the reference sizes its view on the host)."""
    return sgl_kernel_sparse.cells_decode_attention(
        q, flat_k, flat_v, table, req_rows.long(), n_rows, tables.entries, tables.offset, tables.count,
        tables.packed_rows, layer, tables.slots_per_layer, scale)


def decode_over_rows_tail(q, k_cache, v_cache, table, req_rows, sel_rows, tail_start, n_rows, scale: float):
    """q ``[B, Hq, D]``; request b reads rows ``sel_rows[b]`` (``-1`` padding) and ``[tail_start[b],
    n_rows[b])`` of its slot-table row. No host sync on CUDA."""
    return sgl_kernel_sparse.rows_tail_decode_attention(
        q, k_cache, v_cache, table, req_rows.long(), sel_rows, tail_start, n_rows, scale)
