"""KV compaction: per (row i, KV head h) ``cache[dst[h, i], h] = cache[src[h, i], h]`` for K and V.

Programs run in no fixed order, so a single in-place pass could overwrite a source another
program has not read yet (compaction moves rows towards the front: ranges overlap). The move is
therefore two launches of one copy kernel on the same stream (the second starts after the first
ends): gather every source into a temporary ``[n, Hkv, D]``, then scatter it to the
destinations. ``assume_disjoint=True`` skips the temporary when no destination is a source.

``segment=B`` (a compaction's moves, ``CacheManager.compact_rows_many``): the entries are runs of
B, one run per (request, layer), each moving a request's kept rows to its first B rows in row
order. One program per (run, KV head) walks its run a tile at a time: it loads the tile's
sources, waits for every thread of the program (``debug_barrier``), then stores; entries whose
source is their destination are neither read nor written. No temporary (a wave's kept KV over
every layer: gigabytes) and half the traffic of the two-launch move. Safe when, within a run, no
entry reads a source that an *earlier* entry writes: true for a compaction, where entry i of a
run reads row ``rows[i] >= i`` of its request and every earlier entry j < i writes row j (a slot
holds one row of one request, so different rows are different slots, and runs never share a
slot: other requests, or other layers' cells).
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


@triton.jit
def _compact_segments_kernel(
    K, V, SRC, DST, seg_len, s_src_h, s_dst_h, s_ks, s_kh, s_vs, s_vh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (run, h): entries [run * seg_len, +seg_len) in order, a tile of BLOCK_N at a time."""
    run = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    base = run * seg_len
    for i0 in range(0, seg_len, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        live = i < seg_len
        src = tl.load(SRC + h * s_src_h + base + i, mask=live, other=0).to(tl.int64)
        dst = tl.load(DST + h * s_dst_h + base + i, mask=live, other=0).to(tl.int64)
        m2 = (live & (src != dst))[:, None] & dmask[None, :]  # entries that stay put: no traffic
        k = tl.load(K + src[:, None] * s_ks + h * s_kh + d[None, :], mask=m2)
        v = tl.load(V + src[:, None] * s_vs + h * s_vh + d[None, :], mask=m2)
        tl.debug_barrier()  # every thread's loads of this tile before any thread's stores
        tl.store(K + dst[:, None] * s_ks + h * s_kh + d[None, :], k, mask=m2)
        tl.store(V + dst[:, None] * s_vs + h * s_vh + d[None, :], v, mask=m2)


def _compact_segments(k_cache, v_cache, src, dst, n, hkv, d, segment, block_n=None):
    if n % segment:
        raise ValueError(f"segment={segment} must divide the {n} entries per head (runs of one length)")
    block_d = pow2(d, 16)
    block_n = block_n or max(16, min(64, 16384 // (block_d * k_cache.element_size())))
    _compact_segments_kernel[(n // segment, hkv)](
        k_cache, v_cache, src, dst, segment, src.stride(0), dst.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
    )


def compact_kv(k_cache, v_cache, src_slots, dst_slots, assume_disjoint=False, segment=None, block_n=None):
    """Triton version of ``reference.compact_kv`` (in place; returns k_cache, v_cache).
    src_slots / dst_slots: ``[Hkv, n]`` or ``[n]`` (shared by all KV heads). ``segment``: the
    entries are runs of that length moved in place, in order (module docstring: a compaction's
    moves only). ``block_n``: rows per tile of the ``segment`` path."""
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
    if segment is not None:
        if src.stride(-1) != 1 or dst.stride(-1) != 1:
            src, dst = src.contiguous(), dst.contiguous()
        _compact_segments(k_cache, v_cache, src, dst, n, hkv, d, segment, block_n)
        return k_cache, v_cache
    if assume_disjoint:
        _copy(k_cache, v_cache, k_cache, v_cache, src, dst, n, hkv, d)
        return k_cache, v_cache
    k_tmp = torch.empty(n, hkv, d, dtype=k_cache.dtype, device=k_cache.device)
    v_tmp = torch.empty(n, hkv, d, dtype=v_cache.dtype, device=v_cache.device)
    ident = torch.arange(n, device=k_cache.device).expand(hkv, n)  # tmp row i <-> entry i
    _copy(k_cache, v_cache, k_tmp, v_tmp, src, ident, n, hkv, d)  # gather: reads only
    _copy(k_tmp, v_tmp, k_cache, v_cache, ident, dst, n, hkv, d)  # scatter: writes only
    return k_cache, v_cache
