"""Top-k selection along rows, in one Triton program per row (CUDA-graph safe, no host sync).

``select_top(scores, k)`` equals ``reference.quest_select_pages(scores, k)`` for an int ``k``: per
row of ``scores [..., P]`` (fp32), the indices of the ``k`` largest finite entries in ascending
order, ties to the lower index, ``-1`` padding at the end where fewer than ``k`` are finite.

How: the row sits in registers; each fp32 is mapped to an int32 with the same order (negative
floats get their 31 magnitude bits flipped). The k-th largest key ``T`` is found bit by bit from
the top (32 counting passes over the row, in an unsigned view of the keys): the largest ``T``
with ``count(key >= T) >= k``. Then, in a second pass over chunks of the row, every key ``> T`` is
taken, and of the keys ``== T`` the first ``k - count(key > T)`` in index order (a running prefix
sum); a second running prefix sum gives each taken index its output position. ``torch.topk`` on the same rows is a sort-based kernel several times slower
at Quest's shapes (8K pages, k = 128), and does not guarantee the tie rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_device, pow2


@triton.jit
def _keys(S, r, s_s, i, P):
    """Row r's scores at ``i`` as signed int32 with the floats' order; ``valid`` = finite."""
    x = tl.load(S + r * s_s + i, mask=i < P, other=-float("inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
    return key, key > -2139095041  # -inf (no page; lanes past P) is -2139095041


@triton.jit
def _select_top_kernel(S, OUT, P, K, s_s, s_o, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    key, valid = _keys(S, r, s_s, tl.arange(0, BLOCK), P)
    # T in the unsigned view u = key + 2^31, built from the top bit down
    t_u = tl.zeros((), dtype=tl.int64)
    for bit in tl.static_range(31, -1, -1):
        cand = t_u | (1 << bit)
        n = tl.sum((valid & (key >= (cand - 2147483648).to(tl.int32))).to(tl.int32), axis=0)
        t_u = tl.where(n >= K, cand, t_u)
    t = (t_u - 2147483648).to(tl.int32)
    room = K - tl.sum((valid & (key > t)).to(tl.int32), axis=0)  # ties that fit, lowest index first
    # second pass in chunks (the whole row's prefix sums would not fit in registers)
    ties = tl.zeros((), dtype=tl.int32)
    taken = tl.zeros((), dtype=tl.int32)
    for c in range(0, P, CHUNK):
        i = c + tl.arange(0, CHUNK)
        ck, cv = _keys(S, r, s_s, i, P)
        tied = cv & (ck == t)
        take = (cv & (ck > t)) | (tied & (ties + tl.cumsum(tied.to(tl.int32), axis=0) <= room))
        pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - 1
        tl.store(OUT + r * s_o + pos, i.to(tl.int64), mask=take)
        ties += tl.sum(tied.to(tl.int32), axis=0)
        taken += tl.sum(take.to(tl.int32), axis=0)
    j = tl.arange(0, BLOCK_K)
    tl.store(OUT + r * s_o + j, tl.full((BLOCK_K,), -1, tl.int64), mask=(j >= taken) & (j < K))


def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """int64 ``[..., min(k, P)]``: see the module docstring. ``scores`` fp32, last dim contiguous."""
    check_device(scores)
    p = scores.shape[-1]
    k = min(int(k), p)
    rows = scores.reshape(-1, p)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    if rows.shape[0] and k:
        block = pow2(p, 16)
        _select_top_kernel[(rows.shape[0],)](
            rows, out, p, k, rows.stride(0), out.stride(0), BLOCK=block, CHUNK=min(block, 1024),
            BLOCK_K=pow2(k, 16),
            num_warps=max(4, min(16, block // 512)),
        )
    return out.view(*scores.shape[:-1], k)
