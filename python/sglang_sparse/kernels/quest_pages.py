"""Quest page summaries kept per *physical* page of the KV pool, and page scoring over a
request's slot-table row. Plain torch, no host sync: safe inside a captured CUDA graph.

Index ranges: the engine allocates KV in pages of ``page`` slots, so row-page ``p`` of a request
(rows ``[p*page, (p+1)*page)`` of its slot-table row) lives in the single physical page
``table[row, p*page] // page``. Summaries ``kmin``/``kmax`` are ``[num_physical_pages, H_kv, d]``;
page 0 holds the engine's padding slot and is never handed to a request, so padded batch entries
(slot 0) may scribble on it. A radix-shared page keeps its summary: nobody rewrites it.
"""

from __future__ import annotations

import torch

import sgl_kernel_sparse


def new_summaries(num_slots: int, page: int, kv_heads: int, head_dim: int, dtype, device):
    pages = -(-num_slots // page)
    kmin = torch.full((pages, kv_heads, head_dim), float("inf"), dtype=dtype, device=device)
    return kmin, torch.full_like(kmin, float("-inf"))


def add_keys(kmin: torch.Tensor, kmax: torch.Tensor, k: torch.Tensor, slots: torch.Tensor, page: int) -> None:
    """Fold keys ``k`` ``[T, H_kv, d]`` just written at ``slots`` ``[T]`` into their pages (any
    number of tokens per page: prefill chunks). A page whose first slot is written here was just
    allocated: its old summary (a released request's) is dropped first. Pages are filled in slot
    order by their owner, so a continued page keeps its running min/max."""
    sgl_kernel_sparse.reference.quest_fold_keys(kmin, kmax, k, slots, page)


def add_decode_keys(kmin, kmax, k, slots, page: int) -> None:
    """``add_keys`` for a decode step (one new token per request, each in its own page): one
    Triton launch on CUDA."""
    sgl_kernel_sparse.quest_fold_decode_keys(kmin, kmax, k, slots, page)


def page_scores(q, kmin, kmax, table, req_rows, n_rows, page: int) -> torch.Tensor:
    """Quest's bound ``sum_c max(q_c * max_c, q_c * min_c)`` per (request, query head, row-page).

    q ``[B, H_q, d]``; table ``[R, max_len]``; req_rows, n_rows ``[B]``. Returns fp32 ``[B, H_q,
    P]`` with ``P = ceil(max_len / page)``; pages ``>= ceil(n_rows / page)`` are ``-inf``. Uses
    ``max(q*M, q*m) = relu(q)*M + min(q,0)*m`` (M >= m), i.e. two batched matmuls; on CUDA one
    sgl-kernel-sparse Triton launch reads each page's summary once through the table."""
    n_pages = (n_rows.long() + page - 1) // page
    if q.is_cuda:
        return sgl_kernel_sparse.quest_page_scores_paged(q, kmin, kmax, table, req_rows.long(), n_pages, page)
    b, hq, d = q.shape
    hkv = kmin.shape[1]
    first_slots = table[req_rows.long()][:, ::page]  # [B, P]: slot of each row-page's first row
    pid = first_slots.long() // page
    mx = kmax[pid].permute(0, 2, 3, 1)  # [B, H_kv, d, P]
    mn = kmin[pid].permute(0, 2, 3, 1)
    qg = q.to(kmin.dtype).view(b, hkv, hq // hkv, d)
    scores = (qg.clamp(min=0) @ mx + qg.clamp(max=0) @ mn).float().reshape(b, hq, -1)
    beyond = torch.arange(scores.shape[-1], device=q.device).view(1, 1, -1) >= n_pages.view(-1, 1, 1)
    return scores.masked_fill(beyond, float("-inf"))


def group_scores(scores: torch.Tensor, group: int) -> torch.Tensor:
    """Per KV head: the sum of its ``group`` query heads' page bounds, ``[B, H_q, P]`` ->
    ``[B, H_q / group, P]`` (query head h belongs to KV head ``h // group``); ``-inf`` pages stay
    ``-inf``."""
    if group == 1:
        return scores
    b, hq, p = scores.shape
    return scores.view(b, hq // group, group, p).sum(dim=2)


def top_pages(scores: torch.Tensor, n_sel: int) -> torch.Tensor:
    """Top ``n_sel`` row-pages per (request, head): int64 ``[B, H_q, min(n_sel, P)]``, ascending,
    ties to the lower page, ``-1`` padding at the end where fewer pages exist (one Triton program
    per row on CUDA, ``sgl_kernel_sparse.triton_select``)."""
    return sgl_kernel_sparse.quest_select_pages(scores, int(n_sel))
