"""FP8 (e4m3) dense decode attention (flash-decoding split-K) over a token-major fp8 KV pool.

Grid ``(B, Hq, S)``. Program (b, h, s) reads KV head ``kvh = h // GROUP`` at positions
``[s*chunk, min((s+1)*chunk, seq_lens[b]))``, ``chunk = cdiv(seq_lens[b], S)`` rounded up to
BLOCK_N (per request, on the device), slot ``req_to_token[req_rows[b], pos]``; rows are loaded as
fp8 and converted to fp32 in registers. The per-head (or per-tensor) scales are applied in
registers too, folded out of the inner loop: ``q . (k8 * ks) = (q * ks) . k8`` and
``sum p (v8 * vs) = vs * sum p v8`` (equal up to fp32 rounding). Online softmax in fp32,
base 2; split partials merged by ``triton_decode._decode_reduce_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .quant import FP8_DTYPE
from .triton_common import LOG2E, check_device, check_gqa, check_rows, check_table, num_sms, pow2
from .triton_decode import _attend_tile, _store_head, merge_splits, split_buffers


@triton.jit
def _fp8_decode_kernel(
    Q, K, V, K_SCALE, V_SCALE, REQ_TO_TOKEN, REQ_ROWS, SEQ_LENS, OUT, O_PART, LSE_PART,
    qk_scale, s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_ksc, s_vsc, s_rt, s_ob, s_oh,
    GROUP: tl.constexpr, SPLIT: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    kvh = h // GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    k_sc = tl.load(K_SCALE + kvh * s_ksc)
    v_sc = tl.load(V_SCALE + kvh * s_vsc)
    # base-2 logits: q * (softmax scale * log2 e) * the head's key scale
    q = (tl.load(Q + b * s_qb + h * s_qh + d, mask=dmask, other=0.0).to(tl.float32) * qk_scale).to(tl.float32) * k_sc

    seq_len = tl.load(SEQ_LENS + b).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(seq_len, n_split), BLOCK_N) * BLOCK_N
    start = s * chunk
    stop = tl.minimum(start + chunk, seq_len)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < stop
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + n, mask=ok, other=0).to(tl.int64)
        m_i, l_i, acc = _attend_tile(K, V, slot, ok, q, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh, m_i, l_i, acc)

    o = acc * (v_sc / tl.where(l_i > 0, l_i, 1.0))  # nothing read (empty request or split): zeros
    _store_head(OUT, O_PART, LSE_PART, o, m_i, l_i, b, h, s, d, dmask, s_ob, s_oh, D, SPLIT)


def _scale_stride(sc, hkv, name):
    if sc.dtype != torch.float32 or sc.numel() not in (1, hkv):
        raise ValueError(f"{name}: fp32 with 1 or Hkv={hkv} entries expected, got "
                         f"{sc.dtype} {tuple(sc.shape)}")
    return 0 if sc.numel() == 1 else sc.reshape(-1).stride(0)


def fp8_decode_attention(q, k8, v8, k_scale, v_scale, req_to_token, req_rows, seq_lens,
                         scale=None, num_splits=None, block_n=None):
    """Triton version of ``quant.fp8_decode_attention`` (``num_splits``: default ~4 programs
    per SM, each split >= 2 tiles of the widest request ``req_to_token.shape[1]``, <= 64).
    No host sync: CUDA-graph safe."""
    b, hq, d = q.shape
    hkv = k8.shape[1]
    check_gqa(hq, hkv)
    if k8.dtype != FP8_DTYPE or v8.dtype != FP8_DTYPE:
        raise ValueError(f"k8/v8 must be {FP8_DTYPE}, got {k8.dtype} / {v8.dtype}")
    if k8.shape[1:] != (hkv, d) or v8.shape[1:] != (hkv, d):
        raise ValueError(f"pools {tuple(k8.shape)} / {tuple(v8.shape)} vs [slots, {hkv}, {d}]")
    s_ksc = _scale_stride(k_scale, hkv, "k_scale")
    s_vsc = _scale_stride(v_scale, hkv, "v_scale")
    check_rows(q, k8, v8)
    check_device(k_scale, v_scale, req_to_token, req_rows, seq_lens)
    check_table(req_to_token)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    block_d = pow2(d, 16)
    if block_n is None:
        block_n = 32 if block_d <= 128 else 16
    if num_splits is None:
        want = triton.cdiv(4 * num_sms(q.device), b * hq)
        num_splits = min(want, triton.cdiv(req_to_token.shape[1], 2 * block_n), 64)
    splits = max(1, int(num_splits))
    split = splits > 1
    o_part, lse_part = split_buffers(out, splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _fp8_decode_kernel[(b, hq, splits)](
        q, k8, v8, k_scale, v_scale, req_to_token, req_rows, seq_lens, out, o_part, lse_part,
        scale * LOG2E, q.stride(0), q.stride(1), k8.stride(0), k8.stride(1),
        v8.stride(0), v8.stride(1), s_ksc, s_vsc, req_to_token.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, SPLIT=split, D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )
    return merge_splits(o_part, lse_part, out, splits)
