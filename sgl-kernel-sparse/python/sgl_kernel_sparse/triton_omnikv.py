"""OmniKV's two decode kernels, graph-safe (no host sync; every bound is read on the device).

``token_logits``: grid ``(B, Hkv, cdiv(L, BLOCK_L))``. Program (b, g, t) loads the keys of
positions ``[t*BLOCK_L, (t+1)*BLOCK_L)`` of request b once (slot = ``req_to_token[req_rows[b],
pos]``, KV head g) and writes the logits of the GROUP query heads that share them; positions
``>= seq_lens[b]`` get ``-inf``. Output fp32 ``[B, Hq, L]``, ``L`` = the slot table's width.

``rows_tail_decode_attention``: grid ``(B, Hkv, S)``. Every query head of a request reads the same
rows (the selection is shared), so program (b, g, s) serves the GROUP query heads of KV head g:
each K/V tile is loaded once for all of them and both products are ``tl.dot``s over a
``[BLOCK_H >= 16, D]`` query tile (rows past GROUP are padding), as ``triton_paged_gqa``.
Request b's view has ``N + T_b`` entries, ``T_b = max(seq_lens[b] - tail_start[b], 0)``:

  n <  N: position = sel_rows[b, n]           (``-1`` = padding; shared by every query head)
  n >= N: position = tail_start[b] + n - N    (the contiguous tail: OmniKV's generated tokens)

Split s of request b takes entries ``[s*c, min((s+1)*c, N + T_b))``, ``c = cdiv(N + T_b, S)``
rounded up to BLOCK_N, computed per request on the device (a long tail does not stretch the
others). Online softmax (fp32, base 2) and split merge are ``triton_decode``'s; fp16 / bf16 dots in
their own dtype with fp32 accumulation, fp32 in 3xTF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, check_gqa, check_rows, check_table, pow2
from .triton_decode import (LOG2E, _group_dot_tile, _group_program, _load_tile, _split_share, _store_group,
                            merge_splits, plan_splits, split_buffers)
from .triton_kivi import plan_tiles


@triton.jit
def _token_logits_kernel(
    Q, K, REQ_TO_TOKEN, REQ_ROWS, SEQ_LENS, OUT, scale, L,
    s_qb, s_qh, s_ks, s_kh, s_rt,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)
    t = tl.program_id(2)
    hq = tl.num_programs(1) * GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    seq = tl.load(SEQ_LENS + b)
    pos = t * BLOCK_L + tl.arange(0, BLOCK_L)
    inside = pos < L
    ok = inside & (pos < seq)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    slot = tl.load(REQ_TO_TOKEN + req * s_rt + pos, mask=ok, other=0).to(tl.int64)
    k = tl.load(K + slot[:, None] * s_ks + g * s_kh + d[None, :], mask=ok[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    for j in tl.static_range(GROUP):
        h = g * GROUP + j
        q = (tl.load(Q + b * s_qb + h * s_qh + d, mask=dmask, other=0.0).to(tl.float32) * scale).to(tl.float32)
        logit = tl.where(ok, tl.sum(k * q[None, :], axis=1), -float("inf"))
        tl.store(OUT + (b * hq + h).to(tl.int64) * L + pos, logit, mask=inside)


@triton.jit
def _rows_tail_partial_kernel(
    Q, K, V, REQ_TO_TOKEN, REQ_ROWS, SEL, TAIL_START, SEQ_LENS, OUT, O_PART, LSE_PART,
    qk_scale, N,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_rt, s_sb, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    DOT16: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, kvh, s, n_split, hq, req, d, dmask, hmask, heads = _group_program(REQ_ROWS, GROUP, BLOCK_H, D, BLOCK_D)
    tail0 = tl.load(TAIL_START + b).to(tl.int64)
    total = N + tl.maximum(tl.load(SEQ_LENS + b).to(tl.int64) - tail0, 0)  # entries of request b's view
    start, stop = _split_share(total, s, n_split, BLOCK_N)
    # the dot takes q as stored; its fp32 logits are scaled by softmax scale * log2(e) (base 2)
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    DT = Q.dtype.element_ty if DOT16 else tl.float32  # dot operands (accumulation is fp32)
    qd = q.to(DT)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        live = n < stop
        chosen = n < N  # entries [0, N): sel_rows; [N, total): the tail
        sel = tl.load(SEL + b * s_sb + n, mask=live & chosen, other=-1).to(tl.int64)
        pos = tl.where(chosen, sel, tail0 + n - N)
        ok = live & (pos >= 0)
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + pos, mask=ok, other=0).to(tl.int64)
        k, v = _load_tile(K, V, slot, ok, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh)
        m_i, l_i, acc = _group_dot_tile(qd, k, v, ok, qk_scale, m_i, l_i, acc, PRECISION)
    _store_group(OUT, O_PART, LSE_PART, acc, m_i, l_i, b, heads, hmask, s, d, dmask, s_ob, s_oh, hq, n_split,
                 D, SPLIT)


def token_logits(q, k_cache, req_to_token, req_rows, seq_lens, scale=None, block_l=64):
    """Triton version of ``reference.token_logits``: fp32 ``[B, Hq, L]``."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    check_rows(q, k_cache)
    check_device(req_to_token, req_rows, seq_lens)
    check_table(req_to_token)
    width = req_to_token.shape[1]
    out = torch.empty(b, hq, width, dtype=torch.float32, device=q.device)
    if b == 0 or width == 0:
        return out
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _token_logits_kernel[(b, hkv, triton.cdiv(width, block_l))](
        q, k_cache, req_to_token, req_rows, seq_lens, out, scale, width,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), req_to_token.stride(0),
        GROUP=hq // hkv, D=d, BLOCK_D=pow2(d, 16), BLOCK_L=block_l, num_warps=4,
    )
    return out


def rows_tail_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, sel_rows, tail_start, seq_lens,
                               scale=None, num_splits=None, block_n=None, expected_tail=None):
    """Triton version of ``reference.rows_tail_decode_attention``. The split count is planned
    for ``N + expected_tail`` entries (default ``N``): a fixed launch shape, so a captured graph
    replays it whatever the tails are. ``block_n`` below 16 is raised to 16 (a ``tl.dot`` side)."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    if sel_rows.dim() != 2 or sel_rows.shape[0] != b or sel_rows.stride(1) != 1:
        raise ValueError(f"sel_rows must be [B, N] with contiguous rows, got {tuple(sel_rows.shape)}")
    check_rows(q, k_cache, v_cache)
    check_device(req_to_token, req_rows, sel_rows, tail_start, seq_lens)
    check_table(req_to_token)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    n = sel_rows.shape[1]
    plan_n = n + (n if expected_tail is None else int(expected_tail))
    block_d, block_n, fp32, dot16 = plan_tiles(q, d, block_n)  # BLOCK_N >= 16, the dot operands' dtype
    block_n, num_splits, _ = plan_splits(b * hkv, plan_n, d, q.device, block_n, num_splits)
    o_part, lse_part = split_buffers(out, num_splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _rows_tail_partial_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, req_to_token, req_rows, sel_rows, tail_start, seq_lens, out, o_part, lse_part,
        scale * LOG2E, n,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), sel_rows.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16), SPLIT=num_splits > 1,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4,
    )
    return merge_splits(o_part, lse_part, out, num_splits)
