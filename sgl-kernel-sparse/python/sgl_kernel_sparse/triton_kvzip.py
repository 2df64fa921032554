"""KVzip's reconstruction-probe scores without materialising the attention matrix.

``reference.kvzip_probe_scores`` builds the probe's whole causal softmax ``[Hq, S, N]`` in fp32
(S probe queries, N = context + probe keys) and takes, for each context position j < C, the max
over probe queries and over the query heads of j's GQA group. At 32K context that is ~2 GB per
256 queries per layer. Here, two passes with flash-attention tiling:

  1. ``_kvzip_lse_kernel``, grid ``(cdiv(S, BLOCK_M), Hq)``: each (query block, query head) runs
     an online max / sum-of-exp2 over the keys it sees (key n <= the query's position; the loop
     stops at the block's largest position) -> log-sum-exp ``lse [Hq, S]`` (base 2).
  2. ``_kvzip_max_kernel``, grid ``(cdiv(C, BLOCK_N), Hkv)``: each block of context keys loops
     over its group's query heads and every probe query block, ``p = 2^(logit - lse)``, and keeps
     the running max -> fp32 ``[Hkv, C]``.

Pass 2 applies no causal mask: every probe query sits at a position >= C, so it sees every
context key (the wrapper checks ``min(q_positions) >= context_len``). fp16 / bf16 inputs go
through tensor-core dots with fp32 accumulation (the products of two 16-bit floats are exact in
fp32, so only the summation order differs from the reference); fp32 inputs use IEEE dots, and
so do bf16 ones under the CPU interpreter (its bf16 dots are wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, check_gqa, check_rows, interpreting, kernel_keys, pow2


@triton.jit
def _logits(Q, s_qs, s_qh, h, m, M, k_t, qk_scale, d, D: tl.constexpr, IEEE: tl.constexpr):
    """[BLOCK_M, BLOCK_N] base-2 logits of query head h's queries m against the key tile k_t."""
    q = tl.load(Q + m[:, None].to(tl.int64) * s_qs + h * s_qh + d[None, :],
                mask=(m[:, None] < M) & (d[None, :] < D), other=0.0)
    if IEEE:  # fp32 tiles (bf16 ones upcast: exact)
        s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k_t)
    return s * qk_scale


@triton.jit
def _keys_t(K, Q, s_kn, s_kh, g, n, N, d, D: tl.constexpr):
    """KV head g's keys n, transposed and in Q's dtype (fp8 keys are converted here): [BLOCK_D, BLOCK_N]."""
    k = tl.load(K + n[None, :].to(tl.int64) * s_kn + g * s_kh + d[:, None],
                mask=(n[None, :] < N) & (d[:, None] < D), other=0.0)
    return k.to(Q.dtype.element_ty)


@triton.jit
def _kvzip_lse_kernel(
    Q, K, POS, LSE, qk_scale, S, N,
    s_qs, s_qh, s_kn, s_kh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    mb = tl.program_id(0)
    h = tl.program_id(1)
    g = h // GROUP
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    # padding queries see key 0 only (a finite lse, never stored)
    pos = tl.load(POS + m, mask=m < S, other=0).to(tl.int64)
    end = tl.minimum(tl.max(pos) + 1, N)
    run_max = tl.full([BLOCK_M], -float("inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(0, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        k_t = _keys_t(K, Q, s_kn, s_kh, g, n, N, d, D)
        s = _logits(Q, s_qs, s_qh, h, m, S, k_t, qk_scale, d, D, IEEE)
        s = tl.where(n[None, :] <= pos[:, None], s, -float("inf"))  # causal (and n < N: pos < N)
        new_max = tl.maximum(run_max, tl.max(s, axis=1))  # finite: key 0 is in the first tile
        run_sum = run_sum * tl.exp2(run_max - new_max) + tl.sum(tl.exp2(s - new_max[:, None]), axis=1)
        run_max = new_max
    tl.store(LSE + h * S + m, run_max + tl.log2(run_sum), mask=m < S)


@triton.jit
def _kvzip_max_kernel(
    Q, K, LSE, OUT, qk_scale, S, C,
    s_qs, s_qh, s_kn, s_kh,
    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    nb = tl.program_id(0)
    g = tl.program_id(1)
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # context positions [0, C)
    d = tl.arange(0, BLOCK_D)
    k_t = _keys_t(K, Q, s_kn, s_kh, g, n, C, d, D)
    best = tl.zeros([BLOCK_N], dtype=tl.float32)  # probabilities are >= 0
    for gi in tl.static_range(GROUP):
        h = g * GROUP + gi
        for m0 in range(0, S, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            s = _logits(Q, s_qs, s_qh, h, m, S, k_t, qk_scale, d, D, IEEE)
            lse = tl.load(LSE + h * S + m, mask=m < S, other=float("inf"))  # padding rows -> 0
            best = tl.maximum(best, tl.max(tl.exp2(s - lse[:, None]), axis=0))
    tl.store(OUT + g * C + n, best, mask=n < C)


def kvzip_probe_scores(q_probe, keys, q_positions, context_len, scale=None, block_m=None, block_n=None):
    """Triton version of ``reference.kvzip_probe_scores``: fp32 ``[Hkv, context_len]``.

    q_probe ``[S, Hq, D]``, keys ``[N, Hkv, D]`` (q's dtype or fp8, rows contiguous in D),
    q_positions ``[S]`` with every entry in ``[context_len, N)``."""
    s = q_probe.shape[0]
    n, hkv = keys.shape[0], keys.shape[1]
    keys = check_two_pass_inputs(q_probe, keys, q_positions, "q_probe")
    if not 0 < context_len <= n or s == 0:
        raise ValueError(f"need 0 < context_len <= N and S > 0, got C={context_len}, N={n}, S={s}")
    lo, hi = int(q_positions.min()), int(q_positions.max())
    if lo < context_len or hi >= n:
        raise ValueError(f"probe positions must lie in [context_len, N) = [{context_len}, {n}), "
                         f"got [{lo}, {hi}]")
    qk_scale, common, strides = two_pass_tiling(q_probe, keys, scale, block_m, block_n)
    lse = row_lse(q_probe, keys, q_positions, qk_scale, common, strides)
    out = torch.empty(hkv, context_len, dtype=torch.float32, device=q_probe.device)
    _kvzip_max_kernel[(triton.cdiv(context_len, common["BLOCK_N"]), hkv)](
        q_probe, keys, lse, out, qk_scale, s, context_len, *strides, **common)
    return out


def check_two_pass_inputs(q, keys, positions, q_name):
    """What both two-pass wrappers (this file's, ``triton_attn_sums``') refuse: a query head
    count that is not a multiple of the KV heads, rows not contiguous in D, keys neither of q's
    dtype nor fp8. Returns the keys the kernels read (``kernel_keys``)."""
    check_gqa(q.shape[1], keys.shape[1])
    check_rows(q, keys, positions)
    return kernel_keys(q, keys, q_name)[0]


def two_pass_tiling(q, keys, scale, block_m, block_n):
    """Launch settings shared by the LSE pass and a second pass over key blocks (this file's max,
    ``triton_attn_sums``' sum): ``(qk_scale, constexprs + num_warps, (q and key strides))``."""
    d, hq, hkv = q.shape[2], q.shape[1], keys.shape[1]
    # Triton's CPU interpreter casts to bf16 by bits (wrong dots): bf16 runs IEEE fp32 dots there
    ieee = q.dtype == torch.float32 or (interpreting() and q.dtype == torch.bfloat16)
    qk_scale = ((1.0 / d**0.5) if scale is None else float(scale)) * LOG2E
    common = dict(GROUP=hq // hkv, D=d, BLOCK_D=pow2(d, 16), BLOCK_M=block_m or (32 if ieee else 64),
                  BLOCK_N=block_n or (32 if ieee else 64), IEEE=ieee, num_warps=4)
    return qk_scale, common, (q.stride(0), q.stride(1), keys.stride(0), keys.stride(1))


def row_lse(q, keys, positions, qk_scale, common, strides):
    """Pass 1: fp32 ``[Hq, S]``, each query row's base-2 log-sum-exp over keys ``<= positions``."""
    s, hq = q.shape[0], q.shape[1]
    lse = torch.empty(hq, s, dtype=torch.float32, device=q.device)
    _kvzip_lse_kernel[(triton.cdiv(s, common["BLOCK_M"]), hq)](
        q, keys, positions.contiguous(), lse, qk_scale, s, keys.shape[0], *strides, **common)
    return lse
