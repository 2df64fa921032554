"""R-KV's redundancy read straight from the pool (``rkv_redundancy_rows``): per request r and KV
head h, over the request's rows ``slots[r, 0:n]``,

    mean_i = (u_i . sum_j u_j - u_i . u_i) / n,   u_j = k_j / (|k_j| + 1e-8)

(``eviction_scores.rkv_redundancy`` before its softmax). One program per (r, h) reads each key
twice (pass 1: the sum of the unit keys; pass 2: each row's dot with it), in fp32, and writes
``[R, Hkv, n]``; the softmax over rows stays in torch. It replaces, per layer of an eviction wave,
a gather of the keys, their fp32 copy and four reductions over it (about 0.2 s of a 179-request
wave on an H100, `docs/measured.md`).

``rkv_redundancy_layers``: the same for every layer of a flat pool (``[layers * S, Hkv, D]``, SGLang's
pool as one allocation, ``flat_kv_pool``) in one launch of ``R x Hkv x layers`` programs. One
layer's launch has ``R x Hkv`` (a wave batch of 15 requests, 8 KV heads: 120 programs on 132 SMs,
each looping over ~2K rows), and a wave paid 36 of them per batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, check_rows, pow2


@triton.jit
def _rkv_mean_similarity_kernel(
    K, SLOTS, OUT, n, s_ks, s_kh, s_kl, s_sr, s_or, s_oh, s_ol,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)  # 0 for one layer's buffer
    K += layer * s_kl
    OUT += layer * s_ol
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n0 in range(0, n, BLOCK_N):  # pass 1: sum of the unit keys
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < n
        slot = tl.load(SLOTS + r * s_sr + rows, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=ok[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        inv = 1.0 / (tl.sqrt(tl.sum(k * k, axis=1)) + 1e-8)
        total += tl.sum(k * inv[:, None], axis=0)
    for n0 in range(0, n, BLOCK_N):  # pass 2: each row's mean similarity to the others
        rows = n0 + tl.arange(0, BLOCK_N)
        ok = rows < n
        slot = tl.load(SLOTS + r * s_sr + rows, mask=ok, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :], mask=ok[:, None] & dmask[None, :],
                    other=0.0).to(tl.float32)
        norm = tl.sqrt(tl.sum(k * k, axis=1))
        inv = 1.0 / (norm + 1e-8)
        dot = tl.sum(k * total[None, :], axis=1) * inv
        own = norm * inv
        tl.store(OUT + r * s_or + h * s_oh + rows, (dot - own * own) / n, mask=ok)


def rkv_redundancy_rows(k_cache, slots, block_n=None):
    """Triton version of ``eviction_scores.rkv_redundancy_rows``: ``k_cache [S, Hkv, D]`` (one
    layer of the pool), ``slots [R, n]`` (request r's row i lives in ``slots[r, i]``) ->
    ``[R, Hkv, n]`` fp32, softmax over the rows."""
    if k_cache.dim() != 3 or slots.dim() != 2:
        raise ValueError(f"k_cache must be [S, Hkv, D] and slots [R, n], got {tuple(k_cache.shape)} "
                         f"and {tuple(slots.shape)}")
    return _redundancy(k_cache, slots, 1, block_n)[:, 0]


def rkv_redundancy_layers(flat_k, slots, num_layers, block_n=None):
    """Triton version of ``eviction_scores.rkv_redundancy_layers``: ``flat_k [layers * S, Hkv, D]``
    (layer l's slot s is cell ``l * S + s``), ``slots [R, n]`` (the same slot in every layer) ->
    ``[R, layers, Hkv, n]`` fp32, softmax over the rows, in one launch."""
    if flat_k.dim() != 3 or slots.dim() != 2 or num_layers < 1 or flat_k.shape[0] % num_layers:
        raise ValueError(f"flat_k must be [layers * S, Hkv, D] for {num_layers} layers and slots [R, n], "
                         f"got {tuple(flat_k.shape)} and {tuple(slots.shape)}")
    return _redundancy(flat_k, slots, num_layers, block_n)


def _redundancy(k_cache, slots, layers, block_n):
    """``[R, layers, Hkv, n]`` over ``layers`` equal parts of ``k_cache``'s rows."""
    check_rows(k_cache)
    check_device(slots)
    slots = slots.contiguous()
    r, n = slots.shape
    _, hkv, d = k_cache.shape
    out = torch.empty(r, layers, hkv, n, dtype=torch.float32, device=k_cache.device)
    if r and n:
        block_d = pow2(d, 16)
        block_n = block_n or max(16, min(64, 8192 // block_d))
        layer_rows = k_cache.shape[0] // layers
        _rkv_mean_similarity_kernel[(r, hkv, layers)](
            k_cache, slots, out, n, k_cache.stride(0), k_cache.stride(1), layer_rows * k_cache.stride(0),
            slots.stride(0), out.stride(0), out.stride(2), out.stride(1),
            D=d, BLOCK_D=block_d, BLOCK_N=block_n, num_warps=4,
        )
    return out.softmax(dim=-1)
