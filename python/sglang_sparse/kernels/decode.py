"""Decode attention over the views of one batch: one ``sgl_kernel_sparse`` launch on CUDA
(Triton), plain torch elsewhere (the CPU path).

- ``decode_over_views``: per-request ``DecodeView`` rows (eager Python hooks);
- ``decode_over_pages``: a batched ``PagedDecodeView`` (graph-safe hooks).

Index ranges: ``rows[i]`` ``[Hq, n_i]`` are row indices of request i's ``req_to_token`` row (for
methods that do not evict, row == logical position); ``valid[i]`` masks padding. Slots are looked
up as ``req_to_token[req_row, row]``.
"""

from __future__ import annotations

import torch

from sglang_sparse.kernels import reference

try:  # the kernel package is optional (installed by `make install`; carried to GPU machines)
    import sgl_kernel_sparse
except ImportError:  # pragma: no cover - exercised where the package is absent
    sgl_kernel_sparse = None


def use_kernel_package(q: torch.Tensor) -> bool:
    return sgl_kernel_sparse is not None and q.is_cuda


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
    if use_kernel_package(q):
        r, v = pad_views(rows, valid, row_limit)
        req = torch.tensor(req_rows, dtype=torch.int64, device=q.device)
        return sgl_kernel_sparse.sparse_decode_attention(q, k_cache, v_cache, req_to_token, req, r, v, scale)
    hq, hkv = q.shape[1], k_cache.shape[1]
    kv_head = (torch.arange(hq, device=q.device) // (hq // hkv)).view(-1, 1)
    out = torch.empty(q.shape[0], hq, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    for i in range(q.shape[0]):
        slots = req_to_token[req_rows[i], rows[i].clamp(max=row_limit[i] - 1)].to(torch.int64)
        out[i] = reference.gathered_decode_attention(q[i], k_cache[slots, kv_head], v_cache[slots, kv_head],
                                                     valid[i], scale)
    return out


def decode_over_pages(q, k_cache, v_cache, table, req_rows, page_ids, n_rows, page: int, scale: float):
    """q ``[B, Hq, D]``; page_ids ``[B, Hq, P]`` row-pages (``-1`` padding); rows ``>= n_rows[b]``
    masked. The kernel package dispatches itself (Triton on CUDA, no host sync, so CUDA graphs
    capture it; its plain-torch reference elsewhere); without it, pages become rows for
    ``decode_over_views``."""
    if sgl_kernel_sparse is not None:
        return sgl_kernel_sparse.paged_sparse_decode_attention(
            q, k_cache, v_cache, table, req_rows.long(), page_ids, n_rows, page, scale)
    rows = (page_ids.clamp(min=0).unsqueeze(-1) * page + torch.arange(page, device=q.device)).flatten(2)
    valid = (page_ids >= 0).repeat_interleave(page, dim=-1) & (rows < n_rows.view(-1, 1, 1))
    return decode_over_views(q, k_cache, v_cache, table, req_rows.tolist(), list(rows), list(valid),
                             n_rows.tolist(), scale)
