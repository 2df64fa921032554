"""``decode_attention_add`` on Triton: a decode step's attention, accumulated per pool slot (the
scores of H2O, R-KV and SkipKV), graph-safe (no host sync; every bound is read on the device).

Two launches over the grid ``(B, Hkv, S)``. Program (b, g, s) serves the GROUP query heads of KV
head g of request b with one ``[BLOCK_H >= 16, D]`` query tile (rows past GROUP are padding, as
in ``triton_paged_gqa``), over split s of the request's rows ``[0, n)``, ``n = min(n_rows[b],
W)``: split s takes ``[s*c, min((s+1)*c, n))``, ``c = cdiv(n, S)`` rounded up to BLOCK_N.

  logits: keys read once (slot = ``req_to_token[req_rows[b], row]``), base-2 logits ``tl.dot``-ed
          and written to the scratch ``[B, Hq, W]``; the split's max and sum per query head to
          ``[B, Hq, S]``;
  add:    the S partials merged into each head's max and sum, the split's logits read back,
          normalized, summed over the group, times ``weight[b]``, added to ``scores[slot, g]``.

Splitting the rows keeps a request's work off one program's serial loop: R-KV counts 8 queries of
every 128, so few requests count at a step, and one program per request (the first version of
this kernel) took 0.27 ms per layer on an H100 for 11 of 166 requests at 2.1K rows, near its
time for all 166. A program whose query adds nothing (``weight[b] == 0``: R-KV outside its
buffer window; or ``new_slots[b] == 0``: a captured batch's padding) reads no row (``n = 0``).
No two programs write one score: a slot holds one row of one request, each split its own rows and
each program its KV head's column. The own slot's zeroing (``new_slots``) is done before the
launches (``index_fill_``), as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, check_gqa, check_rows, check_table, pow2
from .triton_decode import LOG2E, _group_program, _softmax_weights, _split_share
from .triton_kivi import plan_tiles


@triton.jit
def _rows_of(b, s, n_split, N_ROWS, NEW_SLOTS, WEIGHT, W, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (b, ., s): ``(weight, start, stop)``, its rows ``[start, stop)`` (none when the query
    adds nothing)."""
    w = tl.load(WEIGHT + b).to(tl.float32) if HAS_WEIGHT else 1.0
    counts = (tl.load(NEW_SLOTS + b) != 0) & (w != 0.0)
    n = tl.where(counts, tl.minimum(tl.load(N_ROWS + b).to(tl.int64), W), 0)
    start, stop = _split_share(n, s, n_split, BLOCK_N)
    return w, start, stop


@triton.jit
def _scores_logits_kernel(
    Q, K, REQ_TO_TOKEN, REQ_ROWS, N_ROWS, NEW_SLOTS, WEIGHT, SCRATCH, M_PART, L_PART, qk_scale, W,
    s_qb, s_qh, s_ks, s_kh, s_rt,
    HAS_WEIGHT: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    DOT16: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, g, s, n_split, hq, req, d, dmask, hmask, heads = _group_program(REQ_ROWS, GROUP, BLOCK_H, D, BLOCK_D)
    w, start, stop = _rows_of(b, s, n_split, N_ROWS, NEW_SLOTS, WEIGHT, W, HAS_WEIGHT, BLOCK_N)
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    qd = q.to(Q.dtype.element_ty if DOT16 else tl.float32)
    scratch = SCRATCH + (b * hq + heads).to(tl.int64)[:, None] * W  # [BLOCK_H, 1]: each head's logits row
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < stop
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + rows, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * s_ks + g * s_kh + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        logit = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        logit = tl.where(ok[None, :], logit, -float("inf"))
        tl.store(scratch + rows[None, :], logit, mask=hmask[:, None] & ok[None, :])
        p, m_i, alpha = _softmax_weights(logit, m_i)
        l_i = l_i * alpha + tl.sum(p, axis=1)
    part = (b * hq + heads) * n_split + s  # [B, Hq, S]; a split with no rows: max -inf, sum 0
    tl.store(M_PART + part, m_i, mask=hmask)
    tl.store(L_PART + part, l_i, mask=hmask)


@triton.jit
def _scores_add_kernel(
    REQ_TO_TOKEN, REQ_ROWS, N_ROWS, NEW_SLOTS, WEIGHT, SCORES, SCRATCH, M_PART, L_PART, W, s_rt, s_sc,
    HAS_WEIGHT: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    w, start, stop = _rows_of(b, s, n_split, N_ROWS, NEW_SLOTS, WEIGHT, W, HAS_WEIGHT, BLOCK_N)
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    hq = tl.num_programs(1) * GROUP
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    heads = g * GROUP + hh
    ss = tl.arange(0, BLOCK_S)
    pmask = hmask[:, None] & (ss < n_split)[None, :]
    part = (b * hq + heads)[:, None] * n_split + ss[None, :]  # [BLOCK_H, BLOCK_S]
    m_part = tl.load(M_PART + part, mask=pmask & (start < stop), other=-float("inf"))
    m = tl.max(m_part, axis=1)
    m_ref = tl.where(m == -float("inf"), 0.0, m)
    l_sum = tl.sum(tl.load(L_PART + part, mask=pmask & (start < stop), other=0.0) * tl.exp2(m_part - m_ref[:, None]),
                   axis=1)
    inv = tl.where(hmask & (l_sum > 0), w / tl.where(l_sum > 0, l_sum, 1.0), 0.0)  # weight / sum, per head
    scratch = SCRATCH + (b * hq + heads).to(tl.int64)[:, None] * W
    for n0 in range(start, stop, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < stop
        logit = tl.load(scratch + rows[None, :], mask=hmask[:, None] & ok[None, :], other=-float("inf"))
        add = tl.sum(tl.exp2(logit - m_ref[:, None]) * inv[:, None], axis=0)  # [BLOCK_N]: the group's sum
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + rows, mask=ok, other=0).to(tl.int64)
        ptr = SCORES + slot * s_sc + g
        tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + add, mask=ok)


def plan_score_splits(width: int, block_n: int) -> int:
    """Row splits per request: about 4 tiles each, at most 16 (a fixed count per table width, so
    a captured graph replays one launch shape)."""
    return max(1, min(16, triton.cdiv(width, 4 * block_n)))


def decode_attention_add(scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots, weight=None, scale=None,
                         block_n=None, num_splits=None):
    """Triton version of ``eviction_scores.decode_attention_add`` (in place on ``scores``)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    check_rows(q, k_cache)
    check_device(req_to_token, req_rows, n_rows, new_slots, scores, *([] if weight is None else [weight]))
    check_table(req_to_token)
    if scores.dtype != torch.float32 or scores.dim() != 2 or scores.shape[1] != hkv or scores.stride(1) != 1:
        raise ValueError(f"scores must be fp32 [S, {hkv}] with contiguous rows, got {scores.dtype} "
                         f"{tuple(scores.shape)}")
    scores.index_fill_(0, new_slots.long(), 0.0)
    width = req_to_token.shape[1]
    if b == 0 or width == 0:
        return scores
    block_d, block_n, fp32, dot16 = plan_tiles(q, d, block_n)
    splits = int(num_splits or plan_score_splits(width, block_n))
    scratch = torch.empty(b, hq, width, dtype=torch.float32, device=q.device)
    m_part = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    w = new_slots if weight is None else weight.to(torch.float32)  # a bool mask (R-KV) read as 0 / 1
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    grid = (b, hkv, splits)
    block_h = pow2(hq // hkv, 16)
    _scores_logits_kernel[grid](
        q, k_cache, req_to_token, req_rows, n_rows, new_slots, w, scratch, m_part, l_part, scale * LOG2E, width,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        HAS_WEIGHT=weight is not None, GROUP=hq // hkv, BLOCK_H=block_h,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16, D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )
    _scores_add_kernel[grid](
        req_to_token, req_rows, n_rows, new_slots, w, scores, scratch, m_part, l_part, width,
        req_to_token.stride(0), scores.stride(0),
        HAS_WEIGHT=weight is not None, GROUP=hq // hkv, BLOCK_H=block_h, BLOCK_S=pow2(splits),
        BLOCK_N=block_n, num_warps=4,
    )
    return scores
