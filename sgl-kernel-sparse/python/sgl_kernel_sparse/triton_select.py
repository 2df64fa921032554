"""Top-k selection along rows, in one Triton program per row (CUDA-graph safe, no host sync).

``select_top(scores, k)`` equals ``reference.quest_select_pages(scores, k)`` for an int ``k``: per
row of ``scores [..., P]`` (fp32), the indices of the ``k`` largest finite entries in ascending
order, ties to the lower index, ``-1`` padding at the end where fewer than ``k`` are finite.

How: the row sits in registers; each fp32 is mapped to an int32 with the same order (negative
floats get their 31 magnitude bits flipped). The k-th largest key ``T``, i.e. the largest ``T``
with ``count(key >= T) >= k``, is found in an unsigned view of the keys either bit by bit from
the top (``method="bits"``: 32 counting passes over the row), 4 bits at a time
(``method="nibble"``: 8 passes that count all 16 candidates of a nibble at once) or a byte at a time
(``method="radix"``: 4 histogram passes). Then, in a second pass over chunks of the row, every
key ``> T`` is taken, and of the keys ``== T`` the first ``k - count(key > T)`` in index order (a
running prefix sum); a second running prefix sum gives each taken index its output position.
``torch.topk`` on the same rows is a sort-based kernel several times slower at Quest's shapes
(8K pages, k = 128), and does not guarantee the tie rule.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .triton_common import check_device, pow2


@triton.jit
def _keys(S, r, s_s, i, P):
    """Row r's scores at ``i`` as signed int32 with the floats' order; ``valid`` = not -inf (no
    page; lanes past P). ``+ 0.0`` maps -0.0 to +0.0, which the reference's sort ties with it.
    A NaN (never a Quest bound of finite keys) with the sign bit clear would rank above +inf here,
    one with it set below -inf (no page); the reference sorts NaN first and then drops it."""
    x = tl.load(S + r * s_s + i, mask=i < P, other=-float("inf")).to(tl.float32) + 0.0
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped
    return key, key > -2139095041  # -inf (no page; lanes past P) is -2139095041


@triton.jit
def _take_top(S, OUT, r, P, K, s_s, s_o, t, room, CHUNK: tl.constexpr, BLOCK_K: tl.constexpr):
    """Write row r's taken indices in ascending order: every key ``> t``, and of the keys ``== t``
    the first ``room`` in index order; ``-1`` after the last taken up to ``K``."""
    # in chunks (the whole row's prefix sums would not fit in registers)
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


@triton.jit
def _select_top_kernel(S, OUT, P, K, s_s, s_o, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """Threshold bit by bit: 32 counting passes over the row."""
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
    _take_top(S, OUT, r, P, K, s_s, s_o, t, room, CHUNK, BLOCK_K)


@triton.jit
def _select_top_radix_kernel(S, OUT, P, K, s_s, s_o, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    """Threshold a byte at a time: 4 histogram passes (radix select) instead of 32 counts.

    In the unsigned view ``u`` (sign bit flipped: unsigned order = the floats' order), pass p
    fixes byte ``3 - p`` of T: among the keys whose higher bytes equal T's so far, the 256-bin
    histogram of this byte gives ``ge[d]`` = how many have a byte ``>= d``; T's byte is the
    largest d with ``ge[d] >= need``, and ``need`` drops by the count strictly above it. Keys of
    other prefixes go to bins 256-511, which are ignored. Fewer than K finite keys: no byte
    qualifies in any pass, T = 0 (unsigned), as in the bitwise kernel."""
    r = tl.program_id(0).to(tl.int64)
    key, valid = _keys(S, r, s_s, tl.arange(0, BLOCK), P)
    u = (key ^ -2147483648).to(tl.uint32, bitcast=True)
    bins = tl.arange(0, 512)
    low = bins < 256
    prefix = tl.zeros((), dtype=tl.uint32)
    need = K
    for p in tl.static_range(4):
        shift = 24 - 8 * p
        if p == 0:
            match = valid
        else:
            match = valid & ((u >> (shift + 8)) == (prefix >> (shift + 8)))  # the bytes fixed so far
        digit = ((u >> shift) & 0xFF).to(tl.int32)
        hist = tl.histogram(tl.where(match, digit, digit + 256), 512)
        hist = tl.where(low, hist, 0)
        ge = tl.cumsum(hist, axis=0, reverse=True)
        byte = tl.max(tl.where(low & (ge >= need), bins, 0), axis=0)
        need = need - tl.sum(tl.where(bins > byte, hist, 0), axis=0)
        prefix = prefix | (byte.to(tl.uint32) << shift)
    t = (prefix.to(tl.int32, bitcast=True)) ^ -2147483648
    room = K - tl.sum((valid & (key > t)).to(tl.int32), axis=0)  # ties that fit, lowest index first
    _take_top(S, OUT, r, P, K, s_s, s_o, t, room, CHUNK, BLOCK_K)


@triton.jit
def _select_top_nibble_kernel(S, OUT, P, K, s_s, s_o, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                              BLOCK_K: tl.constexpr, SCAN: tl.constexpr):
    """Threshold 4 bits at a time: 8 counting passes, each counting all 16 digit candidates at once.

    The bitwise kernel's 32 passes each end in a block-wide reduction, and at Quest's shapes (few
    rows, 8K pages) those reductions, not the compares, set its time. Here pass p fixes nibble
    ``7 - p`` of T (unsigned view, from the top): ``n[d] = count(key >= T | d << shift)`` for
    every digit d in one sweep, T's nibble is the largest d with ``n[d] >= K`` -- the same greedy
    choice as 4 bitwise passes, so the same T. The row is swept in ``SCAN``-key slices (loaded
    again each pass, from L1/L2) into a ``[SCAN, 16]`` count that is reduced once per pass."""
    r = tl.program_id(0).to(tl.int64)
    digits = tl.arange(0, 16)
    t_u = tl.zeros((), dtype=tl.int64)
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        cand = ((t_u | (digits.to(tl.int64) << shift)) - 2147483648).to(tl.int32)  # signed view
        acc = tl.zeros((SCAN, 16), dtype=tl.int32)
        for c in range(0, P, SCAN):
            key, valid = _keys(S, r, s_s, c + tl.arange(0, SCAN), P)
            acc += (valid[:, None] & (key[:, None] >= cand[None, :])).to(tl.int32)
        n = tl.sum(acc, axis=0)
        d = tl.max(tl.where(n >= K, digits, 0), axis=0)  # n[0] < K: fewer than K finite keys, d = 0
        t_u = t_u | (d.to(tl.int64) << shift)
    t = (t_u - 2147483648).to(tl.int32)
    above = tl.zeros((SCAN,), dtype=tl.int32)
    for c in range(0, P, SCAN):
        key, valid = _keys(S, r, s_s, c + tl.arange(0, SCAN), P)
        above += (valid & (key > t)).to(tl.int32)
    room = K - tl.sum(above, axis=0)  # ties that fit, lowest index first
    _take_top(S, OUT, r, P, K, s_s, s_o, t, room, CHUNK, BLOCK_K)


_KERNELS = {"bits": _select_top_kernel, "radix": _select_top_radix_kernel, "nibble": _select_top_nibble_kernel}


def select_top(scores: torch.Tensor, k: int, method=None, num_warps=None, chunk=None) -> torch.Tensor:
    """int64 ``[..., min(k, P)]``: see the module docstring. ``scores`` fp32, last dim contiguous.
    ``method``: ``"bits"`` (32 counting passes, the default), ``"radix"`` (4 histogram passes) or
    ``"nibble"`` (8 passes of 16 counts); the same indices every way. Options left ``None`` come
    from the device's tuning table (``tuning.py``, keyed by the number of rows), else the defaults."""
    check_device(scores)
    p = scores.shape[-1]
    k = min(int(k), p)
    rows = scores.reshape(-1, p)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape[0], k, dtype=torch.int64, device=scores.device)
    if rows.shape[0] and k:
        # keyed by the number of rows: B * Hq per query head, B * Hkv with --sparse-select-per kv_head
        cfg = tuning.fill("select_top", rows.shape[0], scores.device, method=method, num_warps=num_warps,
                          chunk=chunk)
        kernel = _KERNELS.get(cfg["method"] or "bits")
        if kernel is None:
            raise ValueError(f"select_top method {cfg['method']!r}: allowed {sorted(_KERNELS)}")
        block = pow2(p, 16)
        warps = int(cfg["num_warps"] or max(4, min(16, block // 512)))
        # nibble: [SCAN, 16] int32 counts in registers, 16-32 per thread
        extra = {"SCAN": min(block, max(256, 32 * warps))} if kernel is _select_top_nibble_kernel else {}
        kernel[(rows.shape[0],)](
            rows, out, p, k, rows.stride(0), out.stride(0), BLOCK=block,
            CHUNK=min(block, pow2(cfg["chunk"] or 1024, 16)), BLOCK_K=pow2(k, 16),
            num_warps=warps, **extra,
        )
    return out.view(*scores.shape[:-1], k)
