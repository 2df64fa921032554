"""Plain-torch reference kernels for the sparse hot paths (engine-agnostic, any device).

These are the correctness baseline for faster kernels (Triton / sgl-kernel-sparse) and the CPU
implementation. Conventions:
- keys/queries are post-RoPE; ``k`` is ``[T, H_kv, d]``, ``q`` is ``[T_q, H_q, d]``;
- GQA: query head ``h`` reads KV head ``h // (H_q // H_kv)``;
- scores are computed in fp32;
- every top-k uses one tie rule: higher score first, then the *lower* logical index
  (``stable_topk``), so results do not depend on the backend's top-k implementation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim; ties go to the lower index.
    Returned indices are sorted ascending (the order KV is stored in)."""
    k = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return torch.sort(order[..., :k], dim=-1).values


def window_attention_probs(q_win: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Softmax attention of the last ``w`` prompt queries over all ``L`` keys, causal.

    q_win: ``[w, H_q, d]`` (queries of logical positions ``L-w .. L-1``), k: ``[L, H_kv, d]``.
    Returns fp32 ``[H_q, w, L]``.
    """
    w, hq, d = q_win.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    kq = k.float().repeat_interleave(group, dim=1)  # [L, H_q, d]
    logits = torch.einsum("whd,lhd->hwl", q_win.float(), kq) / math.sqrt(d)
    qpos = torch.arange(length - w, length).view(w, 1)
    causal = torch.arange(length).view(1, length) <= qpos
    logits = logits.masked_fill(~causal.to(logits.device), float("-inf"))
    return torch.softmax(logits, dim=-1)


def snapkv_keep_indices(
    q_win: torch.Tensor, k: torch.Tensor, budget: int, window: int, kernel: int
) -> torch.Tensor:
    """SnapKV selection for one layer of one request, per KV head.

    Logical index ranges (prompt of length L, window w, budget C):
      [0, L-w)  candidates, scored by the window's attention, pooled, top-(C-w) kept per KV head
      [L-w, L)  the observation window, always kept
    Scores are summed over window queries, then averaged over the query heads of each GQA group
    (selection per KV head, so KV can be released physically), then avg-pooled (kernel k,
    padding k//2, stride 1, zero padding counted) along positions.
    Returns ``[H_kv, min(C, L)]`` logical indices, ascending per head. ``L <= C``: all kept.
    """
    length, hkv, _ = k.shape
    if length <= budget:
        return torch.arange(length, device=k.device).expand(hkv, length).clone()
    w = min(window, q_win.shape[0], budget)
    probs = window_attention_probs(q_win[-w:], k)  # [H_q, w, L]
    hq = probs.shape[0]
    scores = probs[:, :, : length - w].sum(dim=1)  # [H_q, L-w]
    scores = scores.view(hkv, hq // hkv, length - w).mean(dim=1)  # [H_kv, L-w]
    if kernel > 1:
        scores = F.avg_pool1d(scores.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
        scores = scores[:, : length - w]
    picked = stable_topk(scores, budget - w)
    win = torch.arange(length - w, length, device=k.device).expand(hkv, w)
    return torch.cat([picked, win], dim=1)


def quest_page_summaries(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page channel-wise min and max of the keys: each ``[n_pages, H_kv, d]``.
    The last page may be partial; its summary covers only its valid tokens."""
    length, hkv, d = k.shape
    n_pages = -(-length // page_size)
    pad = n_pages * page_size - length
    kf = k.float()
    lo = F.pad(kf, (0, 0, 0, 0, 0, pad), value=float("inf")).view(n_pages, page_size, hkv, d)
    hi = F.pad(kf, (0, 0, 0, 0, 0, pad), value=float("-inf")).view(n_pages, page_size, hkv, d)
    return lo.amin(dim=1), hi.amax(dim=1)


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's upper bound per query head and page: ``sum_c max(q_c*M_c, q_c*m_c)``.
    q: ``[H_q, d]`` (one decode query), kmin/kmax: ``[n_pages, H_kv, d]``. Returns ``[H_q, n_pages]``."""
    hq = q.shape[0]
    group = hq // kmin.shape[1]
    qf = q.float().unsqueeze(1)  # [H_q, 1, d]
    mn = kmin.repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, P, d]
    mx = kmax.repeat_interleave(group, dim=1).transpose(0, 1)
    return torch.maximum(qf * mn, qf * mx).sum(dim=-1)


def quest_num_pages(page_budget_tokens: int, page_size: int, n_pages: int) -> int:
    """Pages read per query head: ``min(max(3, budget // page), n_pages)``."""
    return min(max(3, page_budget_tokens // page_size), n_pages)


def quest_select_pages(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, page_budget_tokens: int, page_size: int
) -> torch.Tensor:
    """Top pages per query head by ``quest_page_scores``: ``[H_q, n_sel]`` page ids, ascending."""
    scores = quest_page_scores(q, kmin, kmax)
    return stable_topk(scores, quest_num_pages(page_budget_tokens, page_size, scores.shape[-1]))


def sparse_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """One decode query per head over the tokens where ``token_mask[h, t]`` is true.
    q: ``[H_q, d]``, k/v: ``[T, H_kv, d]``, token_mask: ``[H_q, T]`` bool. Returns ``[H_q, d]``."""
    hq, d = q.shape
    group = hq // k.shape[1]
    kq = k.float().repeat_interleave(group, dim=1)
    vq = v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,thd->ht", q.float(), kq) / math.sqrt(d)
    logits = logits.masked_fill(~token_mask, float("-inf"))
    return torch.einsum("ht,thd->hd", torch.softmax(logits, dim=-1), vq).to(q.dtype)


def gathered_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention over per-head gathered rows.
    q: ``[H_q, d]``, k/v: ``[H_q, n, d]`` (already gathered for each query head's KV head),
    valid: ``[H_q, n]`` bool (False = padding). Returns ``[H_q, d]`` in q's dtype."""
    logits = torch.einsum("hd,hnd->hn", q.float(), k.float()) * scale
    logits = logits.masked_fill(~valid, float("-inf"))
    return torch.einsum("hn,hnd->hd", torch.softmax(logits, dim=-1), v.float()).to(q.dtype)
