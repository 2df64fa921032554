"""Decode attention over per-layer row tables (PyramidKV's packed layout): the index chain of
``reference.cell_table_cells``, computed per entry on the device, so the kernel needs no host
sync and no per-step table (CUDA-graph safe).

Grid ``(B, Hq, S)``. Program (b, h, s) reads KV head ``h // GROUP`` over its share of request
b's view rows ``[s*c, min((s+1)*c, nv))``, ``nv = count[req, layer] + seq_lens[b] -
packed_rows[req]``, ``c = cdiv(nv, S)`` rounded up to BLOCK_N (shares computed per request on
the device: a request's view does not depend on the longest one). View row n is

  n <  B: entry e = o + n, cell = entries[(e // K) * S_L + req_to_token[req, e % K]]
  n >= B: cell = layer * S_L + req_to_token[req, K + n - B]

and the key is ``flat_k[cell, kvh, :D]``. Online softmax in fp32, base 2; split partials merged
by ``triton_decode._decode_reduce_kernel``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import LOG2E, check_device, check_gqa, check_rows, num_sms, pow2
from .triton_decode import _attend_tile, _store_head, merge_splits, split_buffers


@triton.jit
def _cells_partial_kernel(
    Q, K, V, REQ_TO_TOKEN, REQ_ROWS, SEQ_LENS, ENTRIES, OFFSET, COUNT, PACKED, OUT, O_PART, LSE_PART,
    qk_scale, layer, base_cell, slots_per_layer,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_rt, s_or, s_cr, s_ob, s_oh,
    GROUP: tl.constexpr, SPLIT: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    kvh = h // GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    kp = tl.load(PACKED + req).to(tl.int64)  # K: engine rows of the packed region
    cnt = tl.load(COUNT + req * s_cr + layer).to(tl.int64)  # B: this layer's packed rows
    off = tl.load(OFFSET + req * s_or + layer).to(tl.int64)
    nv = tl.maximum(cnt + tl.load(SEQ_LENS + b).to(tl.int64) - kp, 0)
    k1 = tl.maximum(kp, 1)
    chunk = tl.cdiv(tl.cdiv(nv, BLOCK_N), n_split) * BLOCK_N
    start = s * chunk
    stop = tl.minimum(start + chunk, nv)
    row = REQ_TO_TOKEN + req * s_rt
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = (tl.load(Q + b * s_qb + h * s_qh + d, mask=dmask, other=0.0).to(tl.float32) * qk_scale).to(tl.float32)

    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(start, stop, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < stop
        packed = ok & (n < cnt)
        e = off + n
        pslot = tl.load(row + e % k1, mask=packed, other=0).to(tl.int64)
        pcell = tl.load(ENTRIES + (e // k1) * slots_per_layer + pslot, mask=packed, other=0).to(tl.int64)
        tslot = tl.load(row + kp + n - cnt, mask=ok & (n >= cnt), other=0).to(tl.int64)
        cell = tl.where(n < cnt, pcell, base_cell + tslot)  # base_cell: layer * S_L
        m_i, l_i, acc = _attend_tile(K, V, cell, ok, q, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh, m_i, l_i, acc)

    o = acc / tl.where(l_i > 0, l_i, 1.0)
    _store_head(OUT, O_PART, LSE_PART, o, m_i, l_i, b, h, s, d, dmask, s_ob, s_oh, D, SPLIT)


def plan_cell_splits(programs, device, num_splits=None):
    """Splits S from the grid alone (so a captured graph's launch does not depend on lengths):
    ~4 programs per SM, at most 64."""
    if num_splits is not None:
        return max(1, int(num_splits))
    return max(1, min(triton.cdiv(4 * num_sms(device), max(programs, 1)), 64))


def cells_decode_attention(q, flat_k, flat_v, req_to_token, req_rows, seq_lens, entries, offset, count,
                           packed_rows, layer, slots_per_layer, scale=None, num_splits=None, block_n=None):
    """Triton version of ``reference.cells_decode_attention`` (same arguments). No host sync."""
    b, hq, d = q.shape
    hkv = flat_k.shape[1]
    check_gqa(hq, hkv)
    check_rows(q, flat_k, flat_v)
    check_device(req_to_token, req_rows, seq_lens, entries, offset, count, packed_rows)
    if req_to_token.stride(1) != 1 or offset.stride(1) != 1 or count.stride(1) != 1:
        raise ValueError("req_to_token, offset and count rows must be contiguous")
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    block_d = pow2(d, 16)
    if block_n is None:  # 32 x 128 tiles, as the sparse decode kernel
        block_n = 32 if block_d <= 128 else 16
    splits = plan_cell_splits(b * hq, q.device, num_splits)
    split = splits > 1
    o_part, lse_part = split_buffers(out, splits)
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _cells_partial_kernel[(b, hq, splits)](
        q, flat_k, flat_v, req_to_token, req_rows, seq_lens, entries, offset, count, packed_rows,
        out, o_part, lse_part, scale * LOG2E, int(layer), int(layer) * int(slots_per_layer), int(slots_per_layer),
        q.stride(0), q.stride(1), flat_k.stride(0), flat_k.stride(1), flat_v.stride(0), flat_v.stride(1),
        req_to_token.stride(0), offset.stride(0), count.stride(0), out.stride(0), out.stride(1),
        GROUP=hq // hkv, SPLIT=split, D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )
    return merge_splits(o_part, lse_part, out, splits)
