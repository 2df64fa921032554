"""Plain-torch references: the ground truth for every Triton kernel of this package (any device).

Formulas follow the project's reference (``sglang_sparse/kernels/reference.py``); this module
only adds the KV-pool indirection SGLang uses. Index conventions, used everywhere:

- *position*: logical token index inside one request, ``0 .. seq_len-1``;
- *slot*: physical row of the token-major KV pool, ``k_cache[slot]`` is ``[H_kv, D]``
  (page size 1); ``req_to_token[req_row, position] -> slot``;
- GQA: query head ``h`` reads KV head ``h // (H_q // H_kv)``;
- scores / softmax / accumulation in fp32; outputs of attention in ``q``'s dtype;
- a query head that reads no valid token gets a zero output (softmax over nothing is 0/0).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


# ------------------------------------------------------------------ sparse decode attention


def sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, rows, valid, scale=None):
    """One decode query per (request, query head) over the positions it selects.

    q ``[B, Hq, D]``; k_cache/v_cache ``[num_slots, Hkv, D]``; req_to_token ``[R, max_ctx]``;
    req_rows ``[B]`` (row of req_to_token per request); rows ``[B, Hq, N]`` positions (any
    value where invalid); valid ``[B, Hq, N]`` bool. Returns ``[B, Hq, D]`` in q's dtype.
    """
    b, hq, d = q.shape
    group = hq // k_cache.shape[1]
    rows = torch.where(valid, rows.long(), 0)
    slots = req_to_token[req_rows.long()].long().gather(1, rows.view(b, -1)).view(rows.shape)
    kvh = (torch.arange(hq, device=q.device) // group).view(1, hq, 1)
    k = k_cache[slots, kvh].float()  # [B, Hq, N, D]
    v = v_cache[slots, kvh].float()
    logits = torch.einsum("bhd,bhnd->bhn", q.float(), k) * _scale(scale, d)
    logits = logits.masked_fill(~valid, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    probs = torch.where(valid.any(dim=-1, keepdim=True), probs, 0.0)  # all-invalid head -> zeros
    return torch.einsum("bhn,bhnd->bhd", probs, v).to(q.dtype)


def pages_to_rows(page_ids, seq_lens, page):
    """Expand page selections to positions: page ``p`` covers positions ``p*page .. p*page+page-1``.
    page_ids ``[B, Hq, P]`` (``-1`` = padding), seq_lens ``[B]``. Returns rows, valid
    ``[B, Hq, P*page]``; positions ``>= seq_lens[b]`` (the partial last page) are invalid."""
    j = torch.arange(page, device=page_ids.device)
    pid = page_ids.long()
    rows = (pid.unsqueeze(-1) * page + j).flatten(-2)
    valid = (pid.unsqueeze(-1) >= 0).expand(*pid.shape, page).flatten(-2)
    valid = valid & (rows < seq_lens.view(-1, 1, 1).long())
    return torch.where(valid, rows, 0), valid


def paged_sparse_decode_attention(
    q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, page, scale=None
):
    """``sparse_decode_attention`` over whole pages (Quest): see ``pages_to_rows``."""
    rows, valid = pages_to_rows(page_ids, seq_lens, page)
    return sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, rows, valid, scale)


# ------------------------------------------------------------------ Quest


def quest_update_summaries(k_cache, req_to_token, req_rows, starts, ends, kmin, kmax, page,
                           summary_rows=None):
    """Fold the keys of positions ``[starts[i], ends[i])`` of request i into its page summaries.

    kmin/kmax ``[S, P_max, Hkv, D]`` (any float dtype), row ``summary_rows[i]`` (default
    ``req_rows[i]``). Contract: positions ``[0, starts[i])`` are already summarized. A page that
    begins before ``starts[i]`` is merged (min/max with its stored value); a page that begins at
    or after it is overwritten. In place; returns (kmin, kmax).
    """
    req_rows, starts, ends = (torch.as_tensor(x).view(-1) for x in (req_rows, starts, ends))
    summary_rows = req_rows if summary_rows is None else torch.as_tensor(summary_rows).view(-1)
    for i in range(req_rows.numel()):
        s, e, r, sr = int(starts[i]), int(ends[i]), int(req_rows[i]), int(summary_rows[i])
        for p in range(s // page, -(-e // page)):
            lo, hi = max(p * page, s), min((p + 1) * page, e)
            if lo >= hi:
                continue
            k = k_cache[req_to_token[r, lo:hi].long()].float()  # [hi-lo, Hkv, D]
            mn, mx = k.amin(dim=0), k.amax(dim=0)
            if lo > p * page:  # page already holds positions [p*page, lo)
                mn = torch.minimum(mn, kmin[sr, p].float())
                mx = torch.maximum(mx, kmax[sr, p].float())
            kmin[sr, p] = mn.to(kmin.dtype)
            kmax[sr, p] = mx.to(kmax.dtype)
    return kmin, kmax


def quest_page_scores(q, kmin, kmax, n_pages, summary_rows=None):
    """Quest upper bound ``sum_c max(q_c*M_c, q_c*m_c)`` per (request, query head, page).

    q ``[B, Hq, D]``; kmin/kmax ``[S, P, Hkv, D]`` read at row ``summary_rows[b]`` (default b);
    n_pages ``[B]``. Returns fp32 ``[B, Hq, P]``, ``-inf`` for pages ``>= n_pages[b]``.
    """
    b, hq, _ = q.shape
    rows = torch.arange(b, device=q.device) if summary_rows is None else summary_rows.long()
    group = hq // kmin.shape[2]
    mn = kmin[rows].float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)  # [B, Hq, P, D]
    mx = kmax[rows].float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    qf = q.float().unsqueeze(2)
    scores = torch.maximum(qf * mn, qf * mx).sum(dim=-1)
    p = torch.arange(kmin.shape[1], device=q.device).view(1, 1, -1)
    return scores.masked_fill(p >= n_pages.view(-1, 1, 1).to(q.device), float("-inf"))


def quest_page_scores_paged(q, kmin, kmax, req_to_token, req_rows, n_pages, page):
    """``quest_page_scores`` with summaries per physical KV page: kmin/kmax ``[N_pages, Hkv, D]``;
    row-page p of request b is physical page ``req_to_token[req_rows[b], p*page] // page``.
    Returns fp32 ``[B, Hq, ceil(max_len / page)]``, ``-inf`` for pages ``>= n_pages[b]``."""
    phys = req_to_token[req_rows.long()][:, ::page].long() // page  # [B, P]
    rows = torch.arange(q.shape[0], device=q.device)
    return quest_page_scores(q, kmin[phys], kmax[phys], n_pages, summary_rows=rows)


def quest_select_pages(scores, n_sel):
    """Top-``n_sel[b]`` pages per (request, head), ascending page ids, ``-1`` padding at the end.

    scores ``[B, Hq, P]`` (``-inf`` = no page); n_sel int or ``[B]``. Returns int32
    ``[B, Hq, max(n_sel)]``. Ties go to the lower page index: a *stable* descending sort keeps
    equal scores in index order (the project's ``stable_topk`` rule); ``torch.topk`` gives no
    such guarantee, so it is not used. ``-inf`` pages are never picked.
    """
    b, hq, p = scores.shape
    n_sel = torch.as_tensor(n_sel, device=scores.device).expand(b).long()
    k = min(int(n_sel.max()) if b else 0, p)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    picked_score = scores.gather(-1, order)
    keep = (torch.arange(k, device=scores.device).view(1, 1, k) < n_sel.view(-1, 1, 1))
    keep = keep & (picked_score > float("-inf"))
    order = torch.where(keep, order, p)  # p sorts after every real page id
    order = torch.sort(order, dim=-1).values
    return torch.where(order == p, -1, order).to(torch.int32)


# ------------------------------------------------------------------ SnapKV


def snapkv_window_scores(q_win, k, scale=None, slots=None):
    """SnapKV's raw scores per KV head: the observation window's causal softmax attention, summed
    over window queries, averaged over the query heads of each GQA group.

    q_win ``[W, Hq, D]`` (window query i sits at position ``L-W+i``); k ``[L, Hkv, D]``, or with
    ``slots`` ``[L]`` the KV pool ``[num_slots, Hkv, D]`` read at ``k[slots]``. Returns fp32
    ``[Hkv, L]``; SnapKV's candidates are columns ``[0, L-W)`` (then pool + top-k in torch).
    """
    if slots is not None:
        k = k[slots.long()]
    w, hq, d = q_win.shape
    length, hkv, _ = k.shape
    group = hq // hkv
    kq = k.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("whd,lhd->hwl", q_win.float(), kq) * _scale(scale, d)
    qpos = torch.arange(length - w, length, device=k.device).view(w, 1)
    causal = torch.arange(length, device=k.device).view(1, length) <= qpos
    probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)  # [Hq, W, L]
    return probs.sum(dim=1).view(hkv, group, length).mean(dim=1)


def snapkv_select(scores, window, budget, kernel):
    """SnapKV's kept positions per KV head from ``snapkv_window_scores`` (computed with the last
    ``w = min(window, budget)`` prompt queries): candidates ``[0, L-w)`` avg-pooled (odd
    ``kernel``, zero padding counted, stride 1), top ``budget-w`` by ``stable_topk``, plus the
    window ``[L-w, L)``. Returns ``[Hkv, min(budget, L)]`` positions, ascending per head."""
    hkv, length = scores.shape
    if length <= budget:
        return torch.arange(length, device=scores.device).expand(hkv, length).clone()
    w = min(window, budget)
    cand = scores[:, : length - w]
    if kernel > 1:
        cand = F.avg_pool1d(cand.unsqueeze(1), kernel, stride=1, padding=kernel // 2).squeeze(1)
    picked = stable_topk(cand, budget - w)
    win = torch.arange(length - w, length, device=scores.device).expand(hkv, w)
    return torch.cat([picked, win], dim=1)


def stable_topk(scores, k):
    """Indices of the k largest entries along the last dim, ties to the lower index (stable
    descending sort), returned ascending."""
    k = min(k, scores.shape[-1])
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.sort(order, dim=-1).values


# ------------------------------------------------------------------ KV compaction


def compact_kv(k_cache, v_cache, src_slots, dst_slots):
    """Per-(row, KV head) move: ``cache[dst[h, i], h] = cache[src[h, i], h]`` for K and V, in place.

    src_slots ``[Hkv, n]`` or ``[n]``; dst_slots ``[n]`` or ``[Hkv, n]``; dst slots must be
    distinct per head. All sources are read before any write, so overlapping ranges are safe.
    """
    hkv = k_cache.shape[1]
    n = src_slots.shape[-1]
    src = src_slots.long().expand(hkv, n)
    dst = dst_slots.long().expand(hkv, n)
    h = torch.arange(hkv, device=k_cache.device).view(hkv, 1)
    k_tmp, v_tmp = k_cache[src, h].clone(), v_cache[src, h].clone()  # [Hkv, n, D]
    k_cache[dst, h] = k_tmp
    v_cache[dst, h] = v_tmp
    return k_cache, v_cache
