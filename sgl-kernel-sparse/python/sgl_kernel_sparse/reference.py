"""Plain-torch references: the one definition of every formula of the sparse hot paths (any
device). The Triton kernels of this package are tested against them, sglang_sparse's methods,
its /prune scoring and its CPU path call them; nothing else re-implements them (the quantized
payloads, KIVI and FP8, are defined in the sibling module ``quant``). Index
conventions, used everywhere:

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


# SnapKV's defaults (Li et al., 2024), shared by the snapkv method and /prune's snapkv policy.
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 7


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def attention_probs(q, keys, q_positions, scale=None):
    """Causal softmax attention ``[Hq, S, N]`` (fp32) of queries ``q [S, Hq, D]`` over ``keys
    [N, Hkv, D]`` (positions 0..N-1); query i sees keys ``<= q_positions[i]``. GQA: query head h
    reads KV head ``h // (Hq // Hkv)``."""
    hq, hkv, d = q.shape[1], keys.shape[1], q.shape[2]
    k = keys.float().repeat_interleave(hq // hkv, dim=1)  # [N, Hq, D]
    logits = torch.einsum("shd,nhd->hsn", q.float(), k) * _scale(scale, d)
    visible = torch.arange(keys.shape[0], device=keys.device).view(1, -1) <= q_positions.to(keys.device).view(-1, 1)
    return torch.softmax(logits.masked_fill(~visible.unsqueeze(0), float("-inf")), dim=-1)


def pool_positions(scores, kernel):
    """Average pooling along the last dim (odd ``kernel``, stride 1, zero padding counted), the
    length kept: SnapKV's smoothing of scores over neighbouring positions."""
    if kernel <= 1 or scores.shape[-1] == 0:
        return scores
    shape = scores.shape
    pooled = F.avg_pool1d(scores.reshape(-1, 1, shape[-1]), kernel, stride=1, padding=kernel // 2)
    return pooled.reshape(*shape[:-1], -1)[..., : shape[-1]]


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


def rows_tail_to_rows(sel_rows, tail_start, seq_lens, hq):
    """OmniKV's decode view as per-head rows: request b reads the positions ``sel_rows[b]``
    (``[B, N]``, ``-1`` = padding, every one ``< tail_start[b]``) and then every position of
    ``[tail_start[b], seq_lens[b])``. Returns rows, valid ``[B, hq, N + T]``, ``T`` the longest
    tail (a host read: the reference sizes its view on the host)."""
    b = sel_rows.shape[0]
    tail_len = (seq_lens.long() - tail_start.long()).clamp(min=0)
    t = int(tail_len.max()) if b else 0
    j = torch.arange(t, device=sel_rows.device).view(1, -1)
    rows = torch.cat([sel_rows.long(), tail_start.long().view(-1, 1) + j], dim=1)
    valid = torch.cat([sel_rows >= 0, j < tail_len.view(-1, 1)], dim=1)
    rows = torch.where(valid, rows, 0)
    return rows.unsqueeze(1).expand(b, hq, -1), valid.unsqueeze(1).expand(b, hq, -1)


def rows_tail_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, sel_rows, tail_start,
                               seq_lens, scale=None):
    """``sparse_decode_attention`` over ``rows_tail_to_rows``: the selected positions (shared by
    every query head of a request) plus the contiguous tail ``[tail_start, seq_lens)``."""
    rows, valid = rows_tail_to_rows(sel_rows, tail_start, seq_lens, q.shape[1])
    return sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, rows, valid, scale)


def token_logits(q, k_cache, req_to_token, req_rows, seq_lens, scale=None):
    """Every resident token's logit per query head: ``q_h . k_j * scale`` for positions
    ``j < seq_lens[b]``, ``-inf`` beyond, fp32 ``[B, Hq, L]`` with ``L = req_to_token.shape[1]``
    (a fixed width, so a captured graph sees one shape). OmniKV's filter layers score from it."""
    b, hq, d = q.shape
    width = req_to_token.shape[1]
    n = int(seq_lens.max()) if b else 0  # the reference reads only resident positions
    slots = req_to_token[req_rows.long(), :n].long()  # [B, n]
    k = k_cache[slots].float().repeat_interleave(hq // k_cache.shape[1], dim=2)  # [B, n, Hq, D]
    logits = torch.full((b, hq, width), float("-inf"), dtype=torch.float32, device=q.device)
    logits[:, :, :n] = torch.einsum("bhd,bnhd->bhn", q.float(), k) * _scale(scale, d)
    beyond = torch.arange(width, device=q.device).view(1, 1, -1) >= seq_lens.long().view(-1, 1, 1)
    return logits.masked_fill(beyond, float("-inf"))


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


def paged_gqa_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, page,
                               scale=None):
    """``paged_sparse_decode_attention`` with one page set per KV head: page_ids ``[B, Hkv, P]``,
    query head h reads the pages of KV head ``h // (Hq / Hkv)``."""
    group = q.shape[1] // page_ids.shape[1]
    return paged_sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows,
                                         page_ids.repeat_interleave(group, dim=1), seq_lens, page, scale)


def cell_table_cells(req_to_token, req_rows, seq_lens, entries, offset, count, packed_rows, layer,
                     slots_per_layer):
    """Flat cells each request reads in ``layer`` from per-layer row tables (PyramidKV's packed
    layout, ``sglang_sparse.core.cell_tables``). For request b (``req = req_rows[b]``,
    ``K = packed_rows[req]``, ``B = count[req, layer]``, ``o = offset[req, layer]``) view row n,
    ``0 <= n < B + seq_lens[b] - K``, is

      n <  B: entry e = o + n, stored at ``entries[(e // K) * slots_per_layer + req_to_token[req, e % K]]``
      n >= B: the cell ``layer * slots_per_layer + req_to_token[req, K + n - B]`` (rows after the
              packed region: one per token since, in the layer's own part)

    Returns ``cells [B, N]`` int64 and ``valid [B, N]`` (N = the longest view)."""
    req = req_rows.long()
    k = packed_rows[req].long()
    b_l = count[req, layer].long()
    off = offset[req, layer].long()
    n_view = (b_l + seq_lens.long() - k).clamp(min=0)
    n = torch.arange(int(n_view.max()) if req.numel() else 0, device=req.device).view(1, -1)
    rows = req_to_token[req].long()
    last = rows.shape[1] - 1
    k1 = k.clamp(min=1).view(-1, 1)
    e = off.view(-1, 1) + n
    addr = (e // k1) * slots_per_layer + rows.gather(1, (e % k1).clamp(max=last))
    packed = entries.long()[addr.clamp(0, entries.numel() - 1)]
    tail = layer * slots_per_layer + rows.gather(1, (k.view(-1, 1) + n - b_l.view(-1, 1)).clamp(0, last))
    cells = torch.where(n < b_l.view(-1, 1), packed, tail)
    return cells, n < n_view.view(-1, 1)


def cells_decode_attention(q, flat_k, flat_v, req_to_token, req_rows, seq_lens, entries, offset, count,
                           packed_rows, layer, slots_per_layer, scale=None):
    """Decode attention over per-layer row tables: request b reads the flat cells of
    ``cell_table_cells`` (every query head the same rows). ``flat_k`` / ``flat_v``
    ``[layers * slots_per_layer, Hkv, D]``. Returns ``[B, Hq, D]`` in q's dtype."""
    cells, valid = cell_table_cells(req_to_token, req_rows, seq_lens, entries, offset, count, packed_rows,
                                    layer, slots_per_layer)
    b, hq, _ = q.shape
    n = cells.shape[1]
    own = torch.arange(b, device=q.device)
    rows = torch.arange(n, device=q.device).expand(b, hq, n)
    return sparse_decode_attention(q, flat_k, flat_v, cells, own, rows, valid.unsqueeze(1).expand(b, hq, n),
                                   scale)


# ------------------------------------------------------------------ Quest


def quest_page_summaries(k, page):
    """Quest's page summaries of one request's keys ``k [L, Hkv, D]``: the channel-wise min and
    max of each page of ``page`` positions, each ``[ceil(L/page), Hkv, D]`` (fp32). The last page
    may be partial; its summary covers only its valid positions."""
    length, hkv, d = k.shape
    n_pages = -(-length // page)
    pad = n_pages * page - length
    kf = k.float()
    lo = F.pad(kf, (0, 0, 0, 0, 0, pad), value=float("inf")).view(n_pages, page, hkv, d)
    hi = F.pad(kf, (0, 0, 0, 0, 0, pad), value=float("-inf")).view(n_pages, page, hkv, d)
    return lo.amin(dim=1), hi.amax(dim=1)


def quest_fold_keys(kmin, kmax, k, slots, page):
    """Fold keys ``k [T, Hkv, D]`` just written at pool ``slots [T]`` into the running summaries
    of their physical pages (``kmin``/``kmax [N_pages, Hkv, D]``, page = slot // page), in place.
    A page whose first slot is among ``slots`` was just allocated: its old summary (a released
    request's) is dropped first. Pages fill in slot order, so a continued page keeps its min/max.
    Tokens that start no page reset page 0 instead (the pool's padding page, never read)."""
    pid = slots.long() // page
    fresh = torch.where(slots.long() % page == 0, pid, 0)
    kmin.index_fill_(0, fresh, float("inf"))
    kmax.index_fill_(0, fresh, float("-inf"))
    idx = pid.view(-1, 1, 1).expand(k.shape)
    kmin.scatter_reduce_(0, idx, k.to(kmin.dtype), reduce="amin")
    kmax.scatter_reduce_(0, idx, k.to(kmax.dtype), reduce="amax")


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
    w, hq, _ = q_win.shape
    length, hkv, _ = k.shape
    probs = attention_probs(q_win, k, torch.arange(length - w, length, device=k.device), scale)  # [Hq, W, L]
    return probs.sum(dim=1).view(hkv, hq // hkv, length).mean(dim=1)


def snapkv_select(scores, window, budget, kernel, sinks=0, recent=0):
    """SnapKV's kept positions per KV head from ``snapkv_window_scores`` (computed with the last
    ``w = min(window, budget)`` prompt queries): candidates ``[0, L-w)`` avg-pooled (odd
    ``kernel``, zero padding counted, stride 1), top ``budget-w`` by ``stable_topk``, plus the
    window ``[L-w, L)``. Returns ``[Hkv, min(budget, L)]`` positions, ascending per head.

    ``sinks`` / ``recent`` (0: off, SnapKV as published): the first ``sinks`` positions and the
    last ``max(recent, w)`` are kept whatever their score, inside the budget (they take the
    top-k's first places; pooling still reads their raw scores as neighbours). Needs
    ``sinks + max(recent, w) <= budget`` (the configs check it)."""
    hkv, length = scores.shape
    if length <= budget:
        return torch.arange(length, device=scores.device).expand(hkv, length).clone()
    w = min(window, budget)
    pooled = pool_positions(scores[:, : length - w], kernel)
    if sinks or recent > w:
        pos = torch.arange(length - w, device=scores.device)
        forced = (pos < sinks) | (pos >= length - max(recent, w))
        pooled = pooled.masked_fill(forced, float("inf"))
    picked = stable_topk(pooled, budget - w)
    win = torch.arange(length - w, length, device=scores.device).expand(hkv, w)
    return torch.cat([picked, win], dim=1)


def snapkv_keep_indices(q_win, k, budget, window, kernel, scale=None, slots=None,
                        window_scores=snapkv_window_scores, sinks=0, recent=0):
    """SnapKV's selection for one layer of one request: positions kept per KV head
    ``[Hkv, min(budget, L)]``, ascending.

    Logical ranges (prompt of length L, window w = min(window, len(q_win), budget), budget C):
      ``[0, L-w)``  candidates: the window's attention summed over window queries, averaged over
                    each GQA group (selection per KV head), pooled, top ``C - w`` kept
      ``[L-w, L)``  the observation window, always kept
    ``[0, sinks)``, ``[L-max(recent, w), L)``  always kept too, inside the budget (0: off)
    ``L <= C``: all kept. ``k`` as in ``snapkv_window_scores`` (keys, or the pool with ``slots``);
    ``window_scores`` computes the raw scores (the Triton kernel on CUDA)."""
    length = k.shape[0] if slots is None else slots.numel()
    hkv = k.shape[1]
    if length <= budget:
        return torch.arange(length, device=k.device).expand(hkv, length).clone()
    w = min(window, q_win.shape[0], budget)
    scores = window_scores(q_win[-w:], k, scale=scale, slots=slots)
    return snapkv_select(scores, w, budget, kernel, sinks, recent)


PYRAMIDKV_BETA = 20


def pyramid_budgets(prompt_len, budget, window, num_layers, beta=PYRAMIDKV_BETA):
    """PyramidKV's selected positions per layer (the observation window excluded; each layer
    keeps ``budgets[l] + window``), for a prompt of L tokens and an average budget C
    (window included), w = window:

      min = (C - w) // beta,  max = 2 (C - w) - min
      if max > L - w: max = L - w, min = 2 (C - w) - max
      step = (max - min) // (layers - 1),  budget_l = max - l * step     (layer 0 keeps most)

    ``L <= C``: no compression (every layer keeps L - w); ``L < 2 (C - w)``: uniform SnapKV
    (every layer keeps C - w)."""
    avg = budget - window
    if prompt_len <= budget:
        return [prompt_len - window] * num_layers
    if prompt_len < 2 * avg:
        return [avg] * num_layers
    low = avg // beta
    high = 2 * avg - low
    if high > prompt_len - window:
        high = prompt_len - window
        low = 2 * avg - high
    step = (high - low) // max(num_layers - 1, 1)
    return [high - layer * step for layer in range(num_layers)]


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


# ------------------------------------------------------------------ KVzip


KVZIP_SINKS = 4


def kvzip_probe_scores(q_probe, keys, q_positions, context_len, scale=None):
    """KVzip's importance of the context's positions for one layer: the reconstruction probe's
    causal softmax attention (every key it sees: context + the probe so far), max over probe
    queries and over the query heads of each GQA group.

    q_probe ``[S, Hq, D]`` (probe query i sits at ``q_positions[i] >= context_len``); keys
    ``[N, Hkv, D]`` (positions 0..N-1, the probe's own keys after the context's). Returns fp32
    ``[Hkv, context_len]``. Chunks of probe queries combine by ``torch.maximum``."""
    hq, hkv = q_probe.shape[1], keys.shape[1]
    probs = attention_probs(q_probe, keys, q_positions, scale)[:, :, :context_len]  # [Hq, S, C]
    return probs.amax(dim=1).view(hkv, hq // hkv, context_len).amax(dim=1)


def kvzip_keep_mask(scores, keep_ratio, sinks=KVZIP_SINKS):
    """KVzip's one global selection: ``scores [layers, Hkv, C]`` -> bool ``[layers, Hkv, C]``
    keeping the ``floor(keep_ratio * layers * Hkv * C)`` best (layer, head, position) entries
    over all layers and heads together (a single threshold), the first ``sinks`` positions of
    every layer and head first (they count towards the total). Ties: the earlier entry in
    (layer, head, position) order."""
    layers, hkv, length = scores.shape
    total = layers * hkv * length
    n_keep = max(int(math.floor(keep_ratio * total)), layers * hkv * min(sinks, length))
    flat = scores.float().clone()
    flat[..., :sinks] = float("inf")
    order = torch.sort(-flat.reshape(-1), stable=True).indices[:n_keep]
    mask = torch.zeros(total, dtype=torch.bool, device=scores.device)
    mask[order] = True
    return mask.view(layers, hkv, length)
