"""Accumulated attention (H2O, SkipKV, R-KV's prompt pass) without materialising the attention
matrix: ``out[g, j] = sum_i w_i sum_{h in group(g)} A^h_{i,j}``, the causal softmax of queries
``q [S, Hq, D]`` over keys ``[N, Hkv, D]`` (query i sees keys ``j <= q_rows[i]``), summed over the
queries and over the query heads of each KV head's GQA group -> fp32 ``[Hkv, N]``.

``eviction_scores.attention_sums`` (the plain-torch reference) builds the softmax of blocks of
queries in fp32, ``[Hq, block, N]``: an 8,192-query prompt chunk over ~10K rows is ~2.7 G fp32
logits per layer, the cost that made a 32K prompt of H2O take ~9 s on the H200. Here, two passes
with flash-attention tiling:

  1. the row log-sum-exp ``lse [Hq, S]`` (base 2): ``triton_kvzip``'s LSE pass, whose causal rule
     (key n <= the query's position) is this one with ``q_rows`` as positions;
  2. ``_attn_sums_kernel``, grid ``(cdiv(N, BLOCK_N), Hkv)``: each block of keys loops over its
     group's query heads and the query blocks that can see it (a block whose largest row is below
     the key block's first key is skipped: a chunk's own keys form a triangle), adding
     ``w_i * 2^(logit - lse_i)`` for ``j <= q_rows[i]``.

fp16 / bf16 go through tensor-core dots with fp32 accumulation (products of two 16-bit floats
are exact in fp32, so only the summation order differs from the reference); fp32 uses IEEE
dots, and bf16 does too under the CPU interpreter (its bf16 dots are wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_kvzip import _keys_t, _logits, check_two_pass_inputs, row_lse, two_pass_tiling


@triton.jit
def _attn_sums_kernel(
    Q, K, ROWS, LSE, W, OUT, qk_scale, S, N,
    s_qs, s_qh, s_kn, s_kh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_W: tl.constexpr, IEEE: tl.constexpr,
):
    nb = tl.program_id(0)
    g = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # key rows [0, N)
    d = tl.arange(0, BLOCK_D)
    k_t = _keys_t(K, Q, s_kn, s_kh, g, n, N, d, D)
    first = nb * BLOCK_N  # the block's first key: queries with a smaller row see none of it
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for gi in tl.static_range(GROUP):
        h = g * GROUP + gi
        for m0 in range(0, S, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            rows = tl.load(ROWS + m, mask=m < S, other=-1).to(tl.int64)  # padding: sees nothing
            if tl.max(rows) >= first:
                s = _logits(Q, s_qs, s_qh, h, m, S, k_t, qk_scale, d, D, IEEE)
                lse = tl.load(LSE + h * S + m, mask=m < S, other=0.0)
                p = tl.where(n[None, :] <= rows[:, None], tl.exp2(s - lse[:, None]), 0.0)
                if HAS_W:
                    p = p * tl.load(W + m, mask=m < S, other=0.0)[:, None]
                acc += tl.sum(p, axis=0)
    tl.store(OUT + g * N + n, acc, mask=n < N)


def attention_sums(q, keys, q_rows, scale=None, weights=None, block_m=None, block_n=None, check_rows_range=True):
    """Triton version of ``eviction_scores.attention_sums``: fp32 ``[Hkv, N]``.

    q ``[S, Hq, D]``, keys ``[N, Hkv, D]`` (q's dtype or fp8, rows contiguous in D), q_rows ``[S]`` with
    every entry in ``[0, N)``, weights ``[S]`` (optional, any float dtype).
    ``check_rows_range=False`` skips the range check of ``q_rows`` (two device -> host reads):
    for a caller whose rows are in range by construction (``core.slot_scores``: an ``arange``)."""
    s = q.shape[0]
    n, hkv = keys.shape[0], keys.shape[1]
    keys = check_two_pass_inputs(q, keys, q_rows, "q")
    out = torch.zeros(hkv, n, dtype=torch.float32, device=keys.device)
    if s == 0 or n == 0:
        return out
    if check_rows_range:
        lo, hi = int(q_rows.min()), int(q_rows.max())
        if lo < 0 or hi >= n:
            raise ValueError(f"q_rows must lie in [0, N) = [0, {n}), got [{lo}, {hi}]")
    if weights is not None and weights.shape != (s,):
        raise ValueError(f"weights must have shape [S] = [{s}], got {tuple(weights.shape)}")
    qk_scale, common, strides = two_pass_tiling(q, keys, scale, block_m, block_n)
    lse = row_lse(q, keys, q_rows, qk_scale, common, strides)
    w = weights.to(device=q.device, dtype=torch.float32).contiguous() if weights is not None else lse
    _attn_sums_kernel[(triton.cdiv(n, common["BLOCK_N"]), hkv)](
        q, keys, q_rows.contiguous(), lse, w, out, qk_scale, s, n, *strides, HAS_W=weights is not None, **common)
    return out
