"""KV compaction: per (row i, KV head h) ``cache[dst[h, i], h] = cache[src[h, i], h]`` for K and V.

Programs run in no fixed order, so a single in-place pass could overwrite a source another
program has not read yet (compaction moves rows towards the front: ranges overlap). The move is
therefore two launches of one copy kernel on the same stream (the second starts after the first
ends): gather every source into a temporary ``[n, Hkv, D]``, then scatter it to the
destinations. ``assume_disjoint=True`` skips the temporary when no destination is a source.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, check_rows, pow2


@triton.jit
def _copy_rows_kernel(
    SK, SV, DK, DV, SRC, DST, n,
    s_src_h, s_src_i, s_dst_h, s_dst_i,
    s_sks, s_skh, s_svs, s_svh, s_dks, s_dkh, s_dvs, s_dvh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (nb, h): rows i in [nb*BLOCK_N, +BLOCK_N): D[DST[h,i], h] = S[SRC[h,i], h]."""
    nb = tl.program_id(0)
    h = tl.program_id(1)
    i = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    live = i < n
    src = tl.load(SRC + h * s_src_h + i * s_src_i, mask=live, other=0).to(tl.int64)
    dst = tl.load(DST + h * s_dst_h + i * s_dst_i, mask=live, other=0).to(tl.int64)
    m2 = live[:, None] & (d[None, :] < D)
    k = tl.load(SK + src[:, None] * s_sks + h * s_skh + d[None, :], mask=m2)
    v = tl.load(SV + src[:, None] * s_svs + h * s_svh + d[None, :], mask=m2)
    tl.store(DK + dst[:, None] * s_dks + h * s_dkh + d[None, :], k, mask=m2)
    tl.store(DV + dst[:, None] * s_dvs + h * s_dvh + d[None, :], v, mask=m2)


def _copy(src_k, src_v, dst_k, dst_v, src_idx, dst_idx, n, hkv, d):
    block_d = pow2(d, 16)
    block_n = max(1, min(64, 16384 // (block_d * src_k.element_size())))  # ~16 KB per tile
    _copy_rows_kernel[(triton.cdiv(n, block_n), hkv)](
        src_k, src_v, dst_k, dst_v, src_idx, dst_idx, n,
        src_idx.stride(0), src_idx.stride(1), dst_idx.stride(0), dst_idx.stride(1),
        src_k.stride(0), src_k.stride(1), src_v.stride(0), src_v.stride(1),
        dst_k.stride(0), dst_k.stride(1), dst_v.stride(0), dst_v.stride(1),
        D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )


def compact_kv(k_cache, v_cache, src_slots, dst_slots, assume_disjoint=False):
    """Triton version of ``reference.compact_kv`` (in place; returns k_cache, v_cache).
    src_slots / dst_slots: ``[Hkv, n]`` or ``[n]`` (shared by all KV heads)."""
    _, hkv, d = k_cache.shape
    if v_cache.shape[1:] != k_cache.shape[1:]:
        raise ValueError("k_cache and v_cache must agree on [Hkv, D]")
    n = src_slots.shape[-1]
    if dst_slots.shape[-1] != n:
        raise ValueError(f"src has {n} rows per head, dst {dst_slots.shape[-1]}")
    check_rows(k_cache, v_cache)
    check_device(src_slots, dst_slots)
    if n == 0:
        return k_cache, v_cache
    src = src_slots.expand(hkv, n)  # stride 0 over heads when shared
    dst = dst_slots.expand(hkv, n)
    if assume_disjoint:
        _copy(k_cache, v_cache, k_cache, v_cache, src, dst, n, hkv, d)
        return k_cache, v_cache
    k_tmp = torch.empty(n, hkv, d, dtype=k_cache.dtype, device=k_cache.device)
    v_tmp = torch.empty(n, hkv, d, dtype=v_cache.dtype, device=v_cache.device)
    ident = torch.arange(n, device=k_cache.device).expand(hkv, n)  # tmp row i <-> entry i
    _copy(k_cache, v_cache, k_tmp, v_tmp, src, ident, n, hkv, d)  # gather: reads only
    _copy(k_tmp, v_tmp, k_cache, v_cache, ident, dst, n, hkv, d)  # scatter: writes only
    return k_cache, v_cache
