"""``decode_attention_add`` on Triton: a decode step's attention, accumulated per pool slot (the
scores of H2O, R-KV and SkipKV), graph-safe (no host sync; every bound is read on the device).

Grid ``(B, Hkv)``. Program (b, g) serves the GROUP query heads of KV head g of request b with one
``[BLOCK_H >= 16, D]`` query tile (rows past GROUP are padding, as in ``triton_paged_gqa``):

  pass 1: rows ``[0, n)``, ``n = min(n_rows[b], W)``: keys read once (slot = ``req_to_token[req_rows[b],
          row]``), base-2 logits ``tl.dot``-ed and written to the scratch ``[B, Hq, W]``, the online
          max and sum of every query head kept;
  pass 2: the same rows' logits read back, normalized, summed over the group, times ``weight[b]``,
          added to ``scores[slot, g]``.

A program whose query adds nothing (``weight[b] == 0``: R-KV outside its buffer window; or
``new_slots[b] == 0``: a captured batch's padding) runs no row (``n = 0``), so R-KV pays for the
8 buffered queries of every 128 and not for the other 120. No two programs write one score: a
slot holds one row of one request, and each program writes its own KV head's column. The own
slot's zeroing (``new_slots``) is done before the launch (``index_fill_``), as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, check_gqa, check_rows, check_table, pow2
from .triton_decode import LOG2E, _softmax_weights
from .triton_kivi import plan_tiles


@triton.jit
def _decode_attention_add_kernel(
    Q, K, REQ_TO_TOKEN, REQ_ROWS, N_ROWS, NEW_SLOTS, WEIGHT, SCORES, SCRATCH, qk_scale, W,
    s_qb, s_qh, s_ks, s_kh, s_rt, s_sc,
    HAS_WEIGHT: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
    DOT16: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    hq = tl.num_programs(1) * GROUP
    w = tl.load(WEIGHT + b).to(tl.float32) if HAS_WEIGHT else 1.0
    counts = (tl.load(NEW_SLOTS + b) != 0) & (w != 0.0)
    n = tl.where(counts, tl.minimum(tl.load(N_ROWS + b).to(tl.int64), W), 0)  # rows this program reads
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    heads = g * GROUP + hh
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    qd = q.to(Q.dtype.element_ty if DOT16 else tl.float32)
    scratch = SCRATCH + (b * hq + heads).to(tl.int64)[:, None] * W  # [BLOCK_H, 1]: each head's logits row
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(0, n, BLOCK_N):  # pass 1: logits (base 2) to the scratch; online max and sum
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < n
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + rows, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * s_ks + g * s_kh + d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        logit = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        logit = tl.where(ok[None, :], logit, -float("inf"))
        tl.store(scratch + rows[None, :], logit, mask=hmask[:, None] & ok[None, :])
        p, m_i, alpha = _softmax_weights(logit, m_i)
        l_i = l_i * alpha + tl.sum(p, axis=1)
    tl.debug_barrier()  # pass 2 reads what other threads of this program wrote in pass 1
    m_ref = tl.where(m_i == -float("inf"), 0.0, m_i)
    inv = tl.where(hmask & (l_i > 0), w / tl.where(l_i > 0, l_i, 1.0), 0.0)  # weight / sum, per head
    for n0 in range(0, n, BLOCK_N):  # pass 2: probabilities summed over the group, added per slot
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < n
        logit = tl.load(scratch + rows[None, :], mask=hmask[:, None] & ok[None, :], other=-float("inf"))
        add = tl.sum(tl.exp2(logit - m_ref[:, None]) * inv[:, None], axis=0)  # [BLOCK_N]
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + rows, mask=ok, other=0).to(tl.int64)
        ptr = SCORES + slot * s_sc + g
        tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + add, mask=ok)


def decode_attention_add(scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots, weight=None, scale=None,
                         block_n=None):
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
    scratch = torch.empty(b, hq, width, dtype=torch.float32, device=q.device)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _decode_attention_add_kernel[(b, hkv)](
        q, k_cache, req_to_token, req_rows, n_rows, new_slots,
        new_slots if weight is None else weight.to(torch.float32),  # a bool mask (R-KV) read as 0 / 1
        scores,
        scratch, scale * LOG2E, width,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0), scores.stride(0),
        HAS_WEIGHT=weight is not None, GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16),
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16, D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )
    return scores
