"""Block-sparse causal prefill attention (FlashPrefill), Triton; the reference is
``flashprefill.block_sparse_attention`` (same signature, same index conventions: read that
module's docstring first).

Grid ``(n_qb, Hq)``: program ``(r, h)`` owns the query tile of absolute block ``a = qb0 + r``
(``BLOCK`` rows at absolute positions ``a*BLOCK + [0, BLOCK)``; rows outside the chunk
``[start, start + s)`` are computed on zeros and never stored) for query head ``h``. It walks the
kept key blocks of ``(h, r)`` (ascending block ids, from the mask in torch) in ``BLOCK_N``-key
sub-tiles, with an online softmax in base 2 (``exp2``, the scale folded with ``log2 e``) and
fp32 accumulators; ``tl.dot`` on tensor cores for fp16 / bf16 (probabilities cast to v's dtype
for the PV product), exact IEEE dots for fp32 (meant for the interpreter tests: at prefill
tiles they spill on sm_90, and ``sglang_sparse.kernels.sparse_prefill`` sends fp32 to the
reference). Causal inside a block by absolute position: key ``n`` counts for the query at ``p``
iff ``n <= p``. GQA: KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .flashprefill import _scale, block_layout
from .triton_common import LOG2E, check_device, check_gqa, check_rows, pow2


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _flashprefill_kernel(
    Q, K, V, OUT, KV_BLOCKS, N_KEPT, qk_scale, start, n_keys, qb0,
    s_qs, s_qh, s_ks, s_kh, s_vs, s_vh, s_os, s_oh, s_bh, s_bq, s_nh,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    r = tl.program_id(0)  # mask row: absolute query block qb0 + r
    h = tl.program_id(1)  # query head
    g = h // GROUP  # its KV head
    qpos = (qb0 + r) * BLOCK + tl.arange(0, BLOCK)  # absolute positions of the tile's rows
    q_in = (qpos >= start) & (qpos < n_keys)  # rows of the chunk (n_keys = start + s)
    qrow = (qpos - start).to(tl.int64)  # chunk-relative row of q / out (valid where q_in)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + qrow[:, None] * s_qs + h * s_qh + d[None, :],
                mask=q_in[:, None] & (d[None, :] < D), other=0.0)
    m_i = tl.full([BLOCK], -float("inf"), dtype=tl.float32)  # running max (base-2 logits)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)  # running sum of 2^(logit - m_i)
    acc = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    n_kept = tl.load(N_KEPT + h * s_nh + r)
    for t in range(0, n_kept):
        j = tl.load(KV_BLOCKS + h * s_bh + r * s_bq + t)  # kept key block (absolute)
        for n0 in range(0, BLOCK, BLOCK_N):
            kpos = j * BLOCK + n0 + tl.arange(0, BLOCK_N)  # absolute key positions = rows of k / v
            k_in = kpos < n_keys
            krow = kpos.to(tl.int64)
            kt = tl.load(K + krow[None, :] * s_ks + g * s_kh + d[:, None],
                         mask=k_in[None, :] & (d[:, None] < D), other=0.0)  # [BLOCK_D, BLOCK_N]
            s = _dot(q, kt, IEEE) * qk_scale
            seen = k_in[None, :] & (kpos[None, :] <= qpos[:, None])  # causal by absolute position
            s = tl.where(seen, s, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen nothing yet
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(V + krow[:, None] * s_vs + g * s_vh + dv[None, :],
                         mask=k_in[:, None] & (dv[None, :] < DV), other=0.0)  # [BLOCK_N, BLOCK_DV]
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, IEEE)
            m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(OUT + qrow[:, None] * s_os + h * s_oh + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=q_in[:, None] & (dv[None, :] < DV))


def kept_blocks(mask):
    """``(kv_blocks int32 [Hq, n_qb, n_kb], n_kept int32 [Hq, n_qb])``: each row's kept key
    blocks in ascending order first (a stable sort of ``~mask``), then the dropped ones (never
    read). No host sync."""
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
    return order.to(torch.int32).contiguous(), mask.sum(-1).to(torch.int32).contiguous()


def block_sparse_attention(q, k, v, mask, block: int, start: int = 0, scale=None, block_n=None,
                           num_warps=None):
    """Triton version of ``flashprefill.block_sparse_attention``: ``[s, Hq, Dv]`` in q's dtype.
    ``block`` must be a power of two >= 16 (one query tile per block); ``block_n`` (a power of
    two dividing ``block``, default ``min(block, 64)``) is the key sub-tile."""
    s, hq, d = q.shape
    n, hkv, dv_ = k.shape[0], k.shape[1], v.shape[2]
    check_gqa(hq, hkv)
    qb0, n_qb, n_kb = block_layout(s, start, block)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 16, got {block}")
    if n != start + s or v.shape[0] != n or mask.shape != (hq, n_qb, n_kb):
        raise ValueError(f"need k / v rows {start + s} and mask {(hq, n_qb, n_kb)}, "
                         f"got {n}, {v.shape[0]} and {tuple(mask.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share a dtype among fp16 / bf16 / fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_rows(q, k, v)
    check_device(mask)
    out = torch.empty(s, hq, dv_, dtype=q.dtype, device=q.device)
    if s == 0:
        return out
    block_n = min(block, 64) if block_n is None else block_n
    if block_n < 16 or block % block_n or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16 dividing block, got {block_n}")
    kv_blocks, n_kept = kept_blocks(mask.to(q.device))
    ieee = q.dtype == torch.float32  # exact fp32 products (no TF32)
    _flashprefill_kernel[(n_qb, hq)](
        q, k, v, out, kv_blocks, n_kept, _scale(scale, d) * LOG2E, start, n, qb0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), kv_blocks.stride(0), kv_blocks.stride(1), n_kept.stride(0),
        GROUP=hq // hkv, D=d, DV=dv_, BLOCK_D=pow2(d, 16), BLOCK_DV=pow2(dv_, 16), BLOCK=block,
        BLOCK_N=block_n, IEEE=ieee, num_warps=num_warps or (8 if block >= 128 else 4),
    )
    return out
