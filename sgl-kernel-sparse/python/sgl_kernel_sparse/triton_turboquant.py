"""TurboQuant decode attention (flash-decoding split-K) over blocks of b-bit codes + the
full-precision residual rows. Layout and formulas: ``turboquant.py`` (the reference,
``turboquant_decode_attention``, computes the same thing).

Keys and values of the history are read as codes and never dequantized to the original space:
``q . x_hat = |x| * ((q @ R^T) . c[code])``, so the kernel scores the history with the rotated
query ``qr = q @ R^T`` and sums its values in the rotated space; the residual rows are scored
with ``q`` and summed as they are. One online softmax (fp32, base 2) covers both, with two
accumulators: ``acc_h`` (history, rotated space) and ``acc_r`` (residual). The wrapper rotates
the query before the kernel and the history's output back after it (``o = o_h @ R + o_r``): two
small fp32 matmuls per call in torch (no host sync: CUDA-graph safe).

Grid ``(B, Hkv, S)``. Program (b, kvh, s) serves the GROUP query heads of KV head ``kvh`` (one
``[BLOCK_H >= 16, D]`` query tile, both products ``tl.dot``s, dtypes as in ``triton_kivi``) and
walks
  1. its share of request b's history, seen as ``nt = n_blocks[b] * G`` consecutive tokens:
     ``[s*hc, min((s+1)*hc, nt))`` with ``hc = cdiv(nt, S)`` rounded up to BLOCK_N. Token n is
     token ``t = n % G`` of block ``blk = block_table[req_rows[b], n // G]``; its codes row is
     ``k_codes[blk, kvh, t]`` (``D*b/8`` bytes, unpacked by ``_codes_tile``), its norm
     ``k_norms[blk, kvh, t]``; rotated key = ``k_centroids[code] * norm`` (values likewise). A
     tile may span blocks, so any G works;
  2. its share of the residual rows, as ``triton_kivi``: ``[s*rc, min((s+1)*rc, rl))``,
     ``rl = res_len[b]``, row j at slot ``req_to_token[req_rows[b], j]``.
With S > 1 each program writes its normalized partials (``[o_h, o_r]``, 2*D wide) and its
log-sum-exp, merged by ``triton_decode._decode_reduce_kernel`` (the merge is linear, so the two
halves merge as one row of 2*D).

The centroid of a code comes from a select chain over the 2**b fp32 codebook scalars
(``_centroids``; a per-element gather ran at ~3% of HBM on the H200); the norms scale the logits'
columns and the probabilities, not every coordinate. Status: equal to the reference under the Triton interpreter (``test/
test_turboquant_kernel.py``) and on the H200 (``-m gpu`` cases of the same file); speed:
``bench_kernels.py --only turboquant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, check_device, check_gqa, check_rows, pow2
from .triton_decode import (_group_program, _residual_tile, _softmax_weights, _split_share, merge_splits,
                            split_buffers)
from .triton_kivi import check_tables, plan_kivi_splits, plan_tiles


@triton.jit
def _codes_tile(CODES, row, ok, BITS: tl.constexpr, PACKED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """int32 codes ``[BLOCK_N, BLOCK_D]`` of the packed rows starting at ``CODES + row`` (``row``
    ``[BLOCK_N]`` element offsets, ``ok`` the valid rows; a row is ``PACKED = D*BITS/8`` bytes).

    The row is a little-endian bit stream, channel c in bits ``c*BITS .. c*BITS+BITS-1``. Any 8
    consecutive channels ``8w .. 8w+7`` fill exactly BITS bytes, ``BITS*w .. BITS*w+BITS-1``
    (``8*BITS`` bits), whatever BITS (at 3 bits a code can straddle two bytes, never two words):
    the kernel assembles word w from its BITS bytes (byte i at bit 8*i), then channel
    ``8w + lane`` is ``(word >> lane*BITS) & (2**BITS - 1)``. Each byte is loaded once; the
    ``[BLOCK_N, BLOCK_D/8, 8]`` lanes reshape row-major to channel ``8w + lane``. Channels past D
    (BLOCK_D padding) read the masked bytes as 0: code 0, which the caller masks out."""
    w = tl.arange(0, BLOCK_D // 8)  # word column
    word = tl.zeros([BLOCK_N, BLOCK_D // 8], dtype=tl.int32)
    for i in tl.static_range(BITS):
        byte_col = w * BITS + i
        m = ok[:, None] & (byte_col < PACKED)[None, :]
        byte = tl.load(CODES + row[:, None] + byte_col[None, :], mask=m, other=0).to(tl.int32)
        word = word | (byte << (8 * i))  # at BITS = 4, bit 31 may be set: the mask below drops
    lane = tl.arange(0, 8) * BITS        # the sign bits an arithmetic shift brings in
    code = (word[:, :, None] >> lane[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(code, (BLOCK_N, BLOCK_D))


@triton.jit
def _centroids(CB, code, BITS: tl.constexpr):
    """``CB[code]`` for a tile of codes, as a select chain over the ``2**BITS`` scalars of the
    codebook instead of a per-element gather (on the H200 the gather made the kernel run at ~3%
    of HBM, 2026-12-03: ``kernels_quant_issue17.json``). At 4 bits the 16-way chain is slower than
the old gather (7.0 vs 4.8 ms at batch 22, 32K), but a gather inside this kernel's new form took
15.5 ms (``kernels_quant_issue17_gather4.json``), so every width takes the chain."""
    out = tl.zeros(code.shape, dtype=tl.float32)
    for i in tl.static_range(1 << BITS):
        out = tl.where(code == i, tl.load(CB + i), out)
    return out


@triton.jit
def _online_step(logit, m_i, l_i, acc_a, acc_b):
    """One tile's online-softmax update (base-2 logits ``[BLOCK_H, BLOCK_N]``, invalid ones -inf):
    returns ``(p, m_new, l_i, acc_a, acc_b)`` with both accumulators rescaled (the caller adds
    ``p @ v`` to the one this tile belongs to)."""
    p, m_new, alpha = _softmax_weights(logit, m_i)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, m_new, l_i, acc_a * alpha[:, None], acc_b * alpha[:, None]


@triton.jit
def _turboquant_decode_kernel(
    Q, QR, KC, KN, VC, VN, KCB, VCB, BLOCK_TABLE, REQ_ROWS, N_BLOCKS,
    K, V, REQ_TO_TOKEN, RES_LEN, OUT, O_PART, LSE_PART, qk_scale,
    s_qb, s_qh, s_qrb, s_qrh,
    s_kcb, s_kch, s_kct, s_knb, s_knh, s_knt,
    s_vcb, s_vch, s_vct, s_vnb, s_vnh, s_vnt,
    s_bt, s_ks, s_kh, s_vs, s_vh, s_rt, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr,
    VBITS: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT16: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b, kvh, s, n_split, hq, req, d, dmask, hmask, heads = _group_program(REQ_ROWS, GROUP, BLOCK_H, D, BLOCK_D)
    qmask = hmask[:, None] & dmask[None, :]
    DT = Q.dtype.element_ty if DOT16 else tl.float32  # dot operands (accumulation is fp32)
    # qk_scale = softmax scale * log2(e): logits are in base 2, exp2 below
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    qd = (q * qk_scale).to(DT)  # residual rows: the query as it is
    qr = tl.load(QR + b * s_qrb + heads[:, None] * s_qrh + d[None, :], mask=qmask, other=0.0)
    qrd = (qr.to(tl.float32) * qk_scale).to(DT)  # history: the rotated query (fp32 q @ R^T)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_h = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)  # history, in the rotated space
    acc_r = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)  # residual

    # 1. the history: nt tokens of whole blocks, BLOCK_N at a time (a tile may span blocks)
    h0, h1 = _split_share(tl.load(N_BLOCKS + b).to(tl.int32) * G, s, n_split, BLOCK_N)
    for n0 in range(h0, h1, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < h1
        blk = tl.load(BLOCK_TABLE + req * s_bt + n // G, mask=ok, other=0).to(tl.int64)
        t = (n % G).to(tl.int64)  # token within its block
        cmask = ok[:, None] & dmask[None, :]
        kn = tl.load(KN + blk * s_knb + kvh * s_knh + t * s_knt, mask=ok, other=0.0).to(tl.float32)
        code = _codes_tile(KC, blk * s_kcb + kvh * s_kch + t * s_kct, ok, KBITS, D * KBITS // 8, BLOCK_N, BLOCK_D)
        k = tl.where(cmask, _centroids(KCB, code, KBITS), 0.0)  # rotated unit keys [BLOCK_N, BLOCK_D]
        # the norm scales the logit's column (one multiply per token, not per coordinate)
        logit = tl.dot(qrd, tl.trans(k.to(DT)), input_precision=PRECISION) * kn[None, :]
        logit = tl.where(ok[None, :], logit, -float("inf"))
        p, m_i, l_i, acc_h, acc_r = _online_step(logit, m_i, l_i, acc_h, acc_r)
        vn = tl.load(VN + blk * s_vnb + kvh * s_vnh + t * s_vnt, mask=ok, other=0.0).to(tl.float32)
        code = _codes_tile(VC, blk * s_vcb + kvh * s_vch + t * s_vct, ok, VBITS, D * VBITS // 8, BLOCK_N, BLOCK_D)
        v = tl.where(cmask, _centroids(VCB, code, VBITS), 0.0)  # rotated unit values
        acc_h += tl.dot((p * vn[None, :]).to(DT), v.to(DT), input_precision=PRECISION)

    # 2. full-precision residual rows of the token-major pool
    r0, r1 = _split_share(tl.load(RES_LEN + b).to(tl.int32), s, n_split, BLOCK_N)
    for n0 in range(r0, r1, BLOCK_N):
        logit, slot, row_mask = _residual_tile(K, REQ_TO_TOKEN, qd, n0, r1, req, kvh, d, dmask, s_ks, s_kh, s_rt,
                                               PRECISION, BLOCK_N)
        p, m_i, l_i, acc_h, acc_r = _online_step(logit, m_i, l_i, acc_h, acc_r)
        v = tl.load(V + slot[:, None] * s_vs + kvh * s_vh + d[None, :], mask=row_mask, other=0.0)
        acc_r += tl.dot(p.to(DT), v.to(DT), input_precision=PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # nothing read (empty request or split): zeros
    o_h = acc_h / l_safe[:, None]
    o_r = acc_r / l_safe[:, None]
    # a row of 2*D: [o_h (rotated space), o_r]
    if SPLIT:
        base = (b * hq + heads) * n_split + s  # O_PART [B, Hq, S, 2D], LSE [B, Hq, S]
        tl.store(O_PART + base[:, None] * (2 * D) + d[None, :], o_h, mask=qmask)
        tl.store(O_PART + base[:, None] * (2 * D) + D + d[None, :], o_r, mask=qmask)
        tl.store(LSE_PART + base, tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf")), mask=hmask)
    else:
        row = OUT + b * s_ob + heads[:, None] * s_oh + d[None, :]
        tl.store(row, o_h, mask=qmask)
        tl.store(row + D, o_r, mask=qmask)


def check_turboquant_layout(q, k_codes, k_norms, v_codes, v_norms, rot, k_centroids, v_centroids,
                            k_cache, v_cache, bits):
    """Shapes of a TurboQuant layer (``turboquant.py``); returns ``(Hkv, D, G, k_bits, v_bits)``."""
    kb, vb = (bits, bits) if isinstance(bits, int) else bits
    kb, vb = int(kb), int(vb)
    if q.dim() != 3 or k_cache.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D] and k_cache [slots, Hkv, D], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}")
    _, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    if tuple(k_cache.shape[1:]) != (hkv, d) or tuple(v_cache.shape[1:]) != (hkv, d):
        raise ValueError(f"k_cache / v_cache must be [slots, {hkv}, {d}]")
    group = k_codes.shape[2] if k_codes.dim() == 4 else -1
    for name, codes, norms, cb, nbits in (("k", k_codes, k_norms, k_centroids, kb),
                                          ("v", v_codes, v_norms, v_centroids, vb)):
        if nbits not in (1, 2, 3, 4) or (d * nbits) % 8:
            raise ValueError(f"{name} bits={nbits}: must be 1..4 with D*bits a multiple of 8 (D={d})")
        if codes.dtype != torch.uint8 or codes.dim() != 4 or tuple(codes.shape[1:]) != (hkv, group, d * nbits // 8):
            raise ValueError(f"{name}_codes must be uint8 [n, {hkv}, G, {d * nbits // 8}], got {tuple(codes.shape)}")
        if tuple(norms.shape) != tuple(codes.shape[:3]):
            raise ValueError(f"{name}_norms must be {tuple(codes.shape[:3])}, got {tuple(norms.shape)}")
        if tuple(cb.shape) != (1 << nbits,):
            raise ValueError(f"{name}_centroids must hold {1 << nbits} values, got {tuple(cb.shape)}")
    if tuple(rot.shape) != (d, d):
        raise ValueError(f"rot must be [{d}, {d}], got {tuple(rot.shape)}")
    return hkv, d, group, kb, vb


def turboquant_decode_attention(q, k_codes, k_norms, v_codes, v_norms, rot, k_centroids, v_centroids,
                                block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len,
                                bits, scale=None, num_splits=None, block_n=None, dot16=None, num_stages=None):
    """Triton version of ``turboquant.turboquant_decode_attention`` (same arguments; extra:
    ``num_splits``, ``block_n`` = token tile, ``dot16`` = 16-bit dot operands for fp16/bf16
    inputs, ``num_stages`` = Triton's software pipelining depth, None: its default). Any G;
    ``D * bits`` a multiple of 8. No host sync: CUDA-graph safe."""
    hkv, d, group, kb, vb = check_turboquant_layout(q, k_codes, k_norms, v_codes, v_norms, rot,
                                                    k_centroids, v_centroids, k_cache, v_cache, bits)
    b, hq, _ = q.shape
    check_rows(q, k_codes, v_codes, k_cache, v_cache)
    check_device(k_norms, v_norms, rot, k_centroids, v_centroids, block_table, req_rows, n_blocks,
                 req_to_token, res_len)
    check_tables(req_to_token, block_table)
    if b == 0 or hq == 0:
        return torch.empty_like(q)
    rot = rot.float()
    qr = (q.float() @ rot.t()).contiguous()  # the rotated query, fp32 as the reference's
    kcb = k_centroids.float().contiguous()
    vcb = v_centroids.float().contiguous()
    both = torch.empty(b, hq, 2 * d, dtype=torch.float32, device=q.device)  # [o_h, o_r]
    block_d, block_n, fp32, dot16 = plan_tiles(q, d, block_n, dot16)
    # splits sized as KIVI's, counting the longest possible history in units of 32 tokens
    splits = plan_kivi_splits(b * hkv, triton.cdiv(block_table.shape[1] * group, 32), q.device, num_splits)
    o_part, lse_part = split_buffers(both, splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    launch = {} if num_stages is None else {"num_stages": int(num_stages)}
    _turboquant_decode_kernel[(b, hkv, splits)](
        q, qr, k_codes, k_norms, v_codes, v_norms, kcb, vcb, block_table, req_rows, n_blocks,
        k_cache, v_cache, req_to_token, res_len, both, o_part, lse_part, scale * LOG2E,
        q.stride(0), q.stride(1), qr.stride(0), qr.stride(1),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        k_norms.stride(0), k_norms.stride(1), k_norms.stride(2),
        v_codes.stride(0), v_codes.stride(1), v_codes.stride(2),
        v_norms.stride(0), v_norms.stride(1), v_norms.stride(2),
        block_table.stride(0), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        both.stride(0), both.stride(1),
        GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16), G=group, KBITS=kb, VBITS=vb, SPLIT=splits > 1,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=dot16,
        D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4, **launch,
    )
    both = merge_splits(o_part, lse_part, both, splits)
    return (both[..., :d] @ rot + both[..., d:]).to(q.dtype)  # o_h back from the rotated space
