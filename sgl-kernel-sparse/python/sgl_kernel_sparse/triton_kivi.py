"""KIVI decode attention (flash-decoding split-K): quantized history blocks dequantized in
registers, then the full-precision residual rows. Layout and formulas: ``quant.py``.

Grid ``(B, Hkv, S)``. Program (b, kvh, s) serves the GROUP query heads of KV head ``kvh`` (one
``[BLOCK_H >= 16, D]`` query tile: each block is dequantized once for all of them and both
products are ``tl.dot``s; fp32 inputs use 3xTF32 dots (about fp32 accuracy), fp16/bf16 inputs
dot in their own dtype with fp32 accumulation, 1.3-1.4x faster than tf32 at the 32K capacity shape) and walks
  1. its share of request b's quantized blocks: ``[s*cb, min((s+1)*cb, nb))`` with
     ``nb = n_blocks[b]``, ``cb = cdiv(nb, S)``; block j is ``blk = block_table[req_rows[b], j]``,
     one ``[G, D]`` tile per block: byte ``c // (8/BITS)`` of ``k_codes[blk, kvh, t]`` shifted by
     ``(c % (8/BITS))*BITS`` and masked -> code (each byte loaded once, ``_unpack_tile``); ``key = code * k_scale[blk, kvh, c] +
     k_min[blk, kvh, c]``, ``value = code * v_scale[blk, kvh, t, c // G] + v_min[...]`` (the
     value tile viewed as ``[G, D/G, G]`` so each (token, group) scale is loaded once; G must be
     a power of 2 of at least 16 here);
  2. its share of the residual rows: ``[s*rc, min((s+1)*rc, rl))`` with ``rl = res_len[b]``,
     ``rc = cdiv(rl, S)`` rounded up to BLOCK_N, row j at slot ``req_to_token[req_rows[b], j]``.
The shares are computed per request on the device (no host sync, no dependence on the longest
request). Online softmax in fp32, base 2; with S > 1 each program writes its normalized
partial output and log-sum-exp, merged by ``triton_decode._decode_reduce_kernel``. No
full-precision copy of the history is ever materialized.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import KIVI_GROUP, check_kivi_layout
from .triton_common import LOG2E, check_device, check_rows, interpreting, num_sms, pow2
from .triton_decode import (_group_program, _residual_tile, _softmax_weights, _split_share, _store_group,
                            merge_splits, split_buffers)


@triton.jit
def _unpack_tile(CODES, base, t, jb, mask, s_t, BITS: tl.constexpr, G: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 codes ``[G, BLOCK_D]`` of the packed rows ``CODES + base + t*s_t``: every byte is
    loaded once (``[G, BLOCK_D / (8/BITS)]``, contiguous rows) and split into its 8/BITS channels
    in registers, channel c = (8/BITS)*byte + lane, little end first. (Loading one byte per
    channel instead, 8/BITS times each, made the kernel 2-3x slower on the H200: it is bound by
    load instructions, not bytes.)"""
    PACK: tl.constexpr = 8 // BITS
    byte = tl.load(CODES + base + t[:, None] * s_t + jb[None, :], mask=mask, other=0).to(tl.int32)
    lane = tl.arange(0, PACK) * BITS
    code = (byte[:, :, None] >> lane[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(code, (G, BLOCK_D)).to(tl.float32)


@triton.jit
def _kivi_decode_kernel(
    Q, KC, KS, KM, VC, VS, VM, BLOCK_TABLE, REQ_ROWS, N_BLOCKS,
    K, V, REQ_TO_TOKEN, RES_LEN, OUT, O_PART, LSE_PART, qk_scale,
    s_qb, s_qh,
    s_kcb, s_kch, s_kct, s_ksb, s_ksh, s_kmb, s_kmh,
    s_vcb, s_vch, s_vct, s_vsb, s_vsh, s_vst, s_vmb, s_vmh, s_vmt,
    s_bt, s_ks, s_kh, s_vs, s_vh, s_rt, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT16: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, kvh, s, n_split, hq, req, d, dmask, hmask, heads = _group_program(REQ_ROWS, GROUP, BLOCK_H, D, BLOCK_D)
    # qk_scale = softmax scale * log2(e): logits are in base 2, exp2 below
    q = (tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None] & dmask[None, :],
                other=0.0).to(tl.float32) * qk_scale).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    DT = Q.dtype.element_ty if DOT16 else tl.float32  # dot operands (accumulation is fp32)
    qd = q.to(DT)
    jb = tl.arange(0, BLOCK_D // (8 // BITS))  # byte column of a packed row
    bmask = (tl.arange(0, G)[:, None] < G) & (jb[None, :] < D // (8 // BITS))
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    # 1. quantized blocks, one [G, BLOCK_D] tile each, dequantized once for the GROUP heads
    nb = tl.load(N_BLOCKS + b).to(tl.int32)
    cb = tl.cdiv(nb, n_split)
    j0 = s * cb
    j1 = tl.minimum(j0 + cb, nb)
    t = tl.arange(0, G)  # token in block
    cg = tl.arange(0, BLOCK_D // G)  # value channel group
    gmask = (t[:, None] < G) & (cg[None, :] < D // G)
    for j in range(j0, j1):
        blk = tl.load(BLOCK_TABLE + req * s_bt + j).to(tl.int64)
        ks = tl.load(KS + blk * s_ksb + kvh * s_ksh + d, mask=dmask, other=0.0).to(tl.float32)
        km = tl.load(KM + blk * s_kmb + kvh * s_kmh + d, mask=dmask, other=0.0).to(tl.float32)
        k = _unpack_tile(KC, blk * s_kcb + kvh * s_kch, t, jb, bmask, s_kct, BITS, G, BLOCK_D)
        k = k * ks[None, :] + km[None, :]  # dequantized keys [G, BLOCK_D], registers only
        logit = tl.dot(qd, tl.trans(k.to(DT)), input_precision=PRECISION)  # [BLOCK_H, G]
        p, m_new, alpha = _softmax_weights(logit, m_i)  # every token of a block is valid
        # values: one (scale, min) per token and group of G channels, broadcast over the group
        # by viewing the tile as [G tokens, BLOCK_D // G groups, G channels]
        vs = tl.load(VS + blk * s_vsb + kvh * s_vsh + t[:, None] * s_vst + cg[None, :],
                     mask=gmask, other=0.0).to(tl.float32)
        vm = tl.load(VM + blk * s_vmb + kvh * s_vmh + t[:, None] * s_vmt + cg[None, :],
                     mask=gmask, other=0.0).to(tl.float32)
        v = _unpack_tile(VC, blk * s_vcb + kvh * s_vch, t, jb, bmask, s_vct, BITS, G, BLOCK_D)
        v = tl.reshape(v, (G, BLOCK_D // G, G)) * vs[:, :, None] + vm[:, :, None]
        v = tl.reshape(v, (G, BLOCK_D))
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    # 2. full-precision residual rows of the token-major pool
    r0, r1 = _split_share(tl.load(RES_LEN + b).to(tl.int32), s, n_split, BLOCK_N)
    for n0 in range(r0, r1, BLOCK_N):
        logit, slot, row_mask = _residual_tile(K, REQ_TO_TOKEN, qd, n0, r1, req, kvh, d, dmask, s_ks, s_kh, s_rt,
                                               PRECISION, BLOCK_N)
        p, m_new, alpha = _softmax_weights(logit, m_i)
        v = tl.load(V + slot[:, None] * s_vs + kvh * s_vh + d[None, :], mask=row_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    _store_group(OUT, O_PART, LSE_PART, acc, m_i, l_i, b, heads, hmask, s, d, dmask, s_ob, s_oh, hq, n_split,
                 D, SPLIT)  # nothing read (empty request or split): zeros


def plan_kivi_splits(programs, max_blocks, device, num_splits=None):
    """Splits S: enough for ~8 programs per SM (``programs`` = B * Hkv), each split at least two
    blocks of the longest possible request (``block_table.shape[1]``), at most 64."""
    if num_splits is not None:
        return max(1, int(num_splits))
    want = triton.cdiv(8 * num_sms(device), max(programs, 1))
    return max(1, min(want, triton.cdiv(max_blocks, 2), 64))


def check_tables(req_to_token, block_table) -> None:
    """The kernels read a request's slots and blocks as contiguous rows."""
    if req_to_token.stride(1) != 1 or block_table.stride(1) != 1:
        raise ValueError("req_to_token and block_table rows must be contiguous")


def plan_tiles(q, d, block_n=None, dot16=None):
    """The tiles of the quantized-history GQA kernels (KIVI, TurboQuant, Palu) and OmniKV's rows +
    tail kernel: returns
    ``(BLOCK_D, BLOCK_N, fp32, dot16)``. BLOCK_N: 32 x 128 tiles as the sparse decode kernel, at
    least 16 (a tl.dot dimension); fp32 inputs take 3xTF32 dots, fp16 / bf16 16-bit dot operands
    (``dot16``), except bf16 under Triton's CPU interpreter, which casts to bf16 by bits (wrong
    dots): fp32 there."""
    block_d = pow2(d, 16)
    if block_n is None:
        block_n = 32 if block_d <= 128 else 16
    fp32 = q.dtype == torch.float32
    if dot16 is None:
        dot16 = not fp32 and not (interpreting() and q.dtype == torch.bfloat16)
    return block_d, max(16, block_n), fp32, bool(dot16) and not fp32


def kivi_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, block_table,
                          req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len, bits,
                          group=KIVI_GROUP, scale=None, num_splits=None, block_n=None, dot16=None):
    """Triton version of ``quant.kivi_decode_attention`` (same arguments; ``num_splits``,
    ``block_n`` = residual tile). No host sync: CUDA-graph safe."""
    bits, group = int(bits), int(group)
    hkv, d = check_kivi_layout(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_cache,
                               v_cache, bits, group)
    b, hq, _ = q.shape
    if group & (group - 1) or group < 16:
        raise ValueError(f"the Triton kernel needs a power-of-2 group of at least 16 (a tl.dot tile), got {group}")
    check_rows(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_cache, v_cache)
    check_device(block_table, req_rows, n_blocks, req_to_token, res_len)
    check_tables(req_to_token, block_table)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    block_d, block_n, fp32, dot16 = plan_tiles(q, d, block_n, dot16)
    splits = plan_kivi_splits(b * hkv, block_table.shape[1], q.device, num_splits)
    split = splits > 1
    o_part, lse_part = split_buffers(out, splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _kivi_decode_kernel[(b, hkv, splits)](
        q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, block_table, req_rows, n_blocks,
        k_cache, v_cache, req_to_token, res_len, out, o_part, lse_part, scale * LOG2E,
        q.stride(0), q.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_scale.stride(0), k_scale.stride(1), k_min.stride(0), k_min.stride(1),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_scale.stride(0), v_scale.stride(1), v_scale.stride(2),
        v_min.stride(0), v_min.stride(1), v_min.stride(2),
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16), G=group, BITS=bits, SPLIT=split,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16,
        D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )
    return merge_splits(o_part, lse_part, out, splits)
