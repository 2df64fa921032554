"""Palu decode attention (flash-decoding split-K) over latent blocks + the full-precision residual
rows. Layout and formulas: ``palu.py`` (the reference, ``palu_decode_attention``, computes the
same thing).

Grid ``(B, Hkv, S)``. Program (b, kvh, s) serves the GROUP query heads of KV head ``kvh`` (one
``[BLOCK_H >= 16, *]`` query tile; dot dtypes as in ``triton_kivi``). KV head kvh is head
``hi = kvh % g`` of latent group ``gi = kvh // g``; its factor columns are
``B[gi][:, hi*D : (hi+1)*D]``, its bias ``bias[kvh*D : (kvh+1)*D]``. The program walks

  1. its share of request b's history, seen as ``nt = n_blocks[b] * G`` consecutive tokens:
     ``[s*hc, min((s+1)*hc, nt))``, ``hc = cdiv(nt, S)`` rounded up to BLOCK_N (a tile may span
     blocks: any G). Token n (logical position n) is row ``t = n % G`` of block
     ``blk = block_table[req_rows[b], n // G]``: latents ``lat_k / lat_v[blk, gi, t, :R]``.
     Keys are rebuilt in registers: the rotary channels as two ``[BLOCK_N, F]`` halves
     (``F = rotary_dim / 2``), ``ka = lat @ B[:, c1]``, ``kb = lat @ B[:, c2]`` with
     ``c1 = f, c2 = f + F`` (neox) or ``c1 = 2f, c2 = 2f + 1`` (GPT-J), rotated as
     ``(ka cos - kb sin, kb cos + ka sin)`` with ``cos_sin[n]`` gathered per token; the channels
     ``[rotary_dim, D)`` (``kp = lat @ B[:, rd:]``) pass through. Logits are
     ``qa.ra + qb.rb + qp.kp`` (the query split by the same columns). Values stay latent:
     ``acc_lat [BLOCK_H, R] += p @ lat_v``; after the history, ``acc = acc_lat @ Bv_head + l *
     bias_v`` (linearity: every history probability's value is ``h_v Bv + bias``);
  2. its share of the residual rows, as ``triton_kivi``: ``[s*rc, min((s+1)*rc, rl))``,
     ``rl = res_len[b]``, row j at slot ``req_to_token[req_rows[b], j]`` (already rotated).
One online softmax (fp32, base 2) covers both. With S > 1 each program writes its normalized
partial output and log-sum-exp, merged by ``triton_decode._decode_reduce_kernel``. R, F and the
pass-through width are padded to powers of two >= 16 (tl.dot tiles) with masks. The factor
tiles of the head are loaded once per program (before the loops) and stay in registers: 8 warps
by default (compiled for sm_90 without a GPU, ptxas -v, d 128, tiles of 32 tokens: bf16 r 64
124 registers, r 128 193, no spills; 4 warps spill at r 128; fp32 spills from r 64 at 4 warps, ~320 bytes).
No host sync: CUDA-graph safe. Status: equal to the reference under the Triton interpreter
(``test/test_palu_kernel.py``) and on an H200 at the Qwen3-8B shape
(``benchmark/results/h200/gpu_tests_palu_kernel.txt``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, check_device, check_gqa, check_rows, pow2
from .triton_decode import _residual_tile, _split_share, _store_group, merge_splits, split_buffers
from .triton_decode import _group_softmax_step as _online_step
from .triton_kivi import check_tables, plan_kivi_splits, plan_tiles


@triton.jit
def _palu_decode_kernel(
    Q, LK, LV, BK, BV, BIAS_K, BIAS_V, COS_SIN, BLOCK_TABLE, REQ_ROWS, N_BLOCKS,
    K, V, REQ_TO_TOKEN, RES_LEN, OUT, O_PART, LSE_PART, qk_scale,
    s_qb, s_qh, s_lkb, s_lkg, s_lkt, s_lvb, s_lvg, s_lvt, s_bkg, s_bkr, s_bvg, s_bvr, s_cs,
    s_bt, s_ks, s_kh, s_vs, s_vh, s_rt, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HG: tl.constexpr, G: tl.constexpr,
    R: tl.constexpr, BLOCK_R: tl.constexpr, F: tl.constexpr, BLOCK_F: tl.constexpr,
    STEP: tl.constexpr, OFF: tl.constexpr, PW: tl.constexpr, BLOCK_P: tl.constexpr,
    HAS_BK: tl.constexpr, HAS_BV: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
    DOT16: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the prologue of triton_decode._group_program, in its own order: heads before channels (as
    # one helper call, the reordered PTX of this kernel differs; registers and spills do not)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    hq = tl.num_programs(1) * GROUP
    gi = kvh // HG  # latent group of this KV head, and its head within the group
    hi = kvh % HG
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    DT = Q.dtype.element_ty if DOT16 else tl.float32  # dot operands (accumulation is fp32)
    hh = tl.arange(0, BLOCK_H)  # the GROUP query heads of this KV head (rows >= GROUP: padding)
    hmask = hh < GROUP
    heads = kvh * GROUP + hh
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    f = tl.arange(0, BLOCK_F)  # rotary frequency
    fmask = f < F
    c1 = f * STEP  # its two channels: neox (f, f + F), GPT-J (2f, 2f + 1)
    c2 = f * STEP + OFF
    pc = 2 * F + tl.arange(0, BLOCK_P)  # pass-through channels [rd, D)
    pmask = pc < D
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < R
    # the query, scaled (qk_scale = softmax scale * log2 e: base-2 logits), split by channel set
    qrow = Q + b * s_qb + heads[:, None] * s_qh
    q = tl.load(qrow + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    qd = (q * qk_scale).to(DT)  # residual rows: the whole (rotated) query
    qa = (tl.load(qrow + c1[None, :], mask=hmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
          * qk_scale).to(DT)
    qb = (tl.load(qrow + c2[None, :], mask=hmask[:, None] & fmask[None, :], other=0.0).to(tl.float32)
          * qk_scale).to(DT)
    qp = (tl.load(qrow + pc[None, :], mask=hmask[:, None] & pmask[None, :], other=0.0).to(tl.float32)
          * qk_scale).to(DT)
    # the head's key factor columns [BLOCK_R, *] (loaded once; B_k[gi][:, hi*D + c])
    bk_base = BK + gi * s_bkg + hi * D + rr[:, None] * s_bkr
    bka = tl.load(bk_base + c1[None, :], mask=rmask[:, None] & fmask[None, :], other=0.0).to(DT)
    bkb = tl.load(bk_base + c2[None, :], mask=rmask[:, None] & fmask[None, :], other=0.0).to(DT)
    bkp = tl.load(bk_base + pc[None, :], mask=rmask[:, None] & pmask[None, :], other=0.0).to(DT)
    biasa = tl.zeros([BLOCK_F], dtype=tl.float32)
    biasb = tl.zeros([BLOCK_F], dtype=tl.float32)
    biasp = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_BK:
        biasa = tl.load(BIAS_K + kvh * D + c1, mask=fmask, other=0.0).to(tl.float32)
        biasb = tl.load(BIAS_K + kvh * D + c2, mask=fmask, other=0.0).to(tl.float32)
        biasp = tl.load(BIAS_K + kvh * D + pc, mask=pmask, other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_lat = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)  # history values, latent space

    # 1. the history: nt tokens of whole blocks, BLOCK_N at a time (a tile may span blocks)
    h0, h1 = _split_share(tl.load(N_BLOCKS + b).to(tl.int32) * G, s, n_split, BLOCK_N)
    for n0 in range(h0, h1, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # logical positions
        ok = n < h1
        blk = tl.load(BLOCK_TABLE + req * s_bt + n // G, mask=ok, other=0).to(tl.int64)
        t = (n % G).to(tl.int64)  # row within its block
        lmask = ok[:, None] & rmask[None, :]
        hk = tl.load(LK + blk[:, None] * s_lkb + gi * s_lkg + t[:, None] * s_lkt + rr[None, :], mask=lmask,
                     other=0.0).to(DT)  # [BLOCK_N, BLOCK_R]
        ka = tl.dot(hk, bka, input_precision=PRECISION)  # [BLOCK_N, BLOCK_F], fp32
        kb = tl.dot(hk, bkb, input_precision=PRECISION)
        if HAS_BK:
            ka += biasa[None, :]
            kb += biasb[None, :]
        cmask = ok[:, None] & fmask[None, :]
        cs = COS_SIN + n.to(tl.int64)[:, None] * s_cs + f[None, :]
        cos = tl.load(cs, mask=cmask, other=0.0).to(tl.float32)
        sin = tl.load(cs + F, mask=cmask, other=0.0).to(tl.float32)
        ra = ka * cos - kb * sin  # RoPE at position n, in registers
        rb = kb * cos + ka * sin
        logit = tl.dot(qa, tl.trans(ra.to(DT)), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
        logit += tl.dot(qb, tl.trans(rb.to(DT)), input_precision=PRECISION)
        if PW > 0:  # channels past rotary_dim: unrotated
            kp = tl.dot(hk, bkp, input_precision=PRECISION) + biasp[None, :]  # [BLOCK_N, BLOCK_P]
            logit += tl.dot(qp, tl.trans(kp.to(DT)), input_precision=PRECISION)
        logit = tl.where(ok[None, :], logit, -float("inf"))
        p, m_i, l_i, acc_lat = _online_step(logit, m_i, l_i, acc_lat)
        hv = tl.load(LV + blk[:, None] * s_lvb + gi * s_lvg + t[:, None] * s_lvt + rr[None, :], mask=lmask,
                     other=0.0).to(DT)
        acc_lat += tl.dot(p.to(DT), hv, input_precision=PRECISION)

    # the history's values back from the latent space, once: acc_lat @ Bv_head + l * bias_v
    bv = tl.load(BV + gi * s_bvg + hi * D + rr[:, None] * s_bvr + d[None, :], mask=rmask[:, None] & dmask[None, :],
                 other=0.0).to(tl.float32)
    acc = tl.dot(acc_lat, bv, input_precision="tf32x3")  # [BLOCK_H, BLOCK_D], fp32
    if HAS_BV:
        acc += l_i[:, None] * tl.load(BIAS_V + kvh * D + d, mask=dmask, other=0.0).to(tl.float32)[None, :]

    # 2. full-precision residual rows of the token-major pool
    r0, r1 = _split_share(tl.load(RES_LEN + b).to(tl.int32), s, n_split, BLOCK_N)
    for n0 in range(r0, r1, BLOCK_N):
        logit, slot, row_mask = _residual_tile(K, REQ_TO_TOKEN, qd, n0, r1, req, kvh, d, dmask, s_ks, s_kh, s_rt,
                                               PRECISION, BLOCK_N)
        p, m_i, l_i, acc = _online_step(logit, m_i, l_i, acc)
        v = tl.load(V + slot[:, None] * s_vs + kvh * s_vh + d[None, :], mask=row_mask, other=0.0)
        acc += tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)

    _store_group(OUT, O_PART, LSE_PART, acc, m_i, l_i, b, heads, hmask, s, d, dmask, s_ob, s_oh, hq, n_split,
                 D, SPLIT)


def check_palu_layout(q, lat_k, lat_v, bk, bv, bias_k, bias_v, cos_sin, k_cache, v_cache):
    """Shapes of a Palu layer (``palu.py``); returns ``(Hkv, D, n_groups, g, G, R, rotary_dim)``."""
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] and k_cache [slots, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    if tuple(k_cache.shape[1:]) != (hkv, d) or tuple(v_cache.shape[1:]) != (hkv, d):
        raise ValueError(f"k_cache / v_cache must be [slots, {hkv}, {d}]")
    if lat_k.dim() != 4 or lat_v.shape != lat_k.shape:
        raise ValueError(f"lat_k / lat_v must be one [n, n_groups, G, r], got {tuple(lat_k.shape)}, "
                         f"{tuple(lat_v.shape)}")
    _, ng, group, rank = lat_k.shape
    if ng < 1 or hkv % ng:
        raise ValueError(f"{ng} latent groups do not divide Hkv={hkv}")
    hg = hkv // ng
    for name, fac in (("bk", bk), ("bv", bv)):
        if tuple(fac.shape) != (ng, rank, hg * d):
            raise ValueError(f"{name} must be [{ng}, {rank}, {hg * d}], got {tuple(fac.shape)}")
    for name, bias in (("bias_k", bias_k), ("bias_v", bias_v)):
        if bias is not None and (bias.dim() != 1 or bias.shape[0] != hkv * d or bias.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{hkv * d}] or None")
    rd = cos_sin.shape[-1] if cos_sin.dim() == 2 else -1
    if rd < 2 or rd % 2 or rd > d or cos_sin.stride(-1) != 1:
        raise ValueError(f"cos_sin must be [max_pos, rotary_dim] (rows contiguous) with an even rotary_dim <= {d}, "
                         f"got {tuple(cos_sin.shape)}")
    return hkv, d, ng, hg, group, rank, rd


def palu_decode_attention(q, lat_k, lat_v, bk, bv, bias_k, bias_v, cos_sin, neox, block_table, req_rows, n_blocks,
                          k_cache, v_cache, req_to_token, res_len, scale=None, num_splits=None, block_n=None,
                          dot16=None, num_warps=None):
    """Triton version of ``palu.palu_decode_attention`` (same arguments; extra: ``num_splits``,
    ``block_n`` = token tile, ``dot16`` = 16-bit dot operands for fp16/bf16 inputs, ``num_warps``).
    Any G and
    rank; positions ``[0, n_blocks[b] * G)`` must lie in ``cos_sin`` (not checked: no host sync).
    CUDA-graph safe: grid, splits and allocations depend on shapes only."""
    hkv, d, ng, hg, group, rank, rd = check_palu_layout(q, lat_k, lat_v, bk, bv, bias_k, bias_v, cos_sin,
                                                        k_cache, v_cache)
    b, hq, _ = q.shape
    check_rows(q, lat_k, lat_v, bk, bv, k_cache, v_cache, cos_sin)
    check_device(block_table, req_rows, n_blocks, req_to_token, res_len)
    check_tables(req_to_token, block_table)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    block_d, block_n, fp32, dot16 = plan_tiles(q, d, block_n, dot16)
    # splits sized as KIVI's, counting the longest possible history in units of 32 tokens
    splits = plan_kivi_splits(b * hkv, triton.cdiv(block_table.shape[1] * group, 32), q.device, num_splits)
    o_part, lse_part = split_buffers(out, splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    f = rd // 2
    pw = d - rd
    dummy = lat_k  # never read when the bias is None (HAS_B* = False)
    _palu_decode_kernel[(b, hkv, splits)](
        q, lat_k, lat_v, bk, bv, dummy if bias_k is None else bias_k, dummy if bias_v is None else bias_v,
        cos_sin, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len, out, o_part, lse_part,
        scale * LOG2E,
        q.stride(0), q.stride(1), lat_k.stride(0), lat_k.stride(1), lat_k.stride(2),
        lat_v.stride(0), lat_v.stride(1), lat_v.stride(2), bk.stride(0), bk.stride(1), bv.stride(0), bv.stride(1),
        cos_sin.stride(0), block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16), HG=hg, G=group, R=rank, BLOCK_R=pow2(rank, 16),
        F=f, BLOCK_F=pow2(f, 16), STEP=1 if neox else 2, OFF=f if neox else 1, PW=pw, BLOCK_P=pow2(pw, 16),
        HAS_BK=bias_k is not None, HAS_BV=bias_v is not None, SPLIT=splits > 1,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
        # 4 warps up to rank 64 (H200, B=22, 32K, r 64: 1.39 vs 1.53 ms at 8,
        # kernels_palu_sweep_issue17.json); 8 above (4 spill at r 128 in the compile report)
        num_warps=(4 if pow2(rank, 16) <= 64 else 8) if num_warps is None else int(num_warps),
    )
    return merge_splits(o_part, lse_part, out, splits)
