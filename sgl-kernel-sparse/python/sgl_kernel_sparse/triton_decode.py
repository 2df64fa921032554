"""Sparse decode attention (flash-decoding style) over per-query-head selected positions.

Grid ``(B, Hq, S)``: program (b, h, s) handles entries ``[s*chunk, min((s+1)*chunk, N))`` of
query head h's selection in blocks of BLOCK_N with an online softmax (fp32, base 2). With S > 1
(split-K) each program writes a normalized partial output and its log-sum-exp; a second kernel
merges the S partials. Index chain for entry n of (b, h):
  position = rows[b, h, n]                      (rows mode; valid[b, h, n] masks it)
  position = page_ids[b, h, n // PAGE] * PAGE + n % PAGE   (paged mode; masked by page_id < 0
                                                            and position >= seq_lens[b])
  slot     = req_to_token[req_rows[b], position]
  key      = k_cache[slot, h // GROUP, :D]       (one contiguous row of D elements)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .triton_common import LOG2E, check_device, check_gqa, check_rows, check_table, num_sms, pow2


@triton.jit
def _load_tile(K, V, rows, ok, kvh, d, dmask, s_k, s_kh, s_v, s_vh):
    """Keys and values of KV head ``kvh`` at the pool rows ``rows`` (``[BLOCK_N]``, ``ok`` marks
    the valid ones): both loads are issued before either is used."""
    tile_mask = ok[:, None] & dmask[None, :]
    k = tl.load(K + rows[:, None] * s_k + kvh * s_kh + d[None, :], mask=tile_mask, other=0.0)
    v = tl.load(V + rows[:, None] * s_v + kvh * s_vh + d[None, :], mask=tile_mask, other=0.0)
    return k, v


@triton.jit
def _softmax_tile(k, v, ok, q, m_i, l_i, acc):
    """One tile of one query head's online softmax (fp32, base-2 logits: ``q`` carries the
    softmax scale times log2 e) over loaded keys / values. Returns the updated ``(m_i, l_i, acc)``."""
    logit = tl.sum(k.to(tl.float32) * q[None, :], axis=1)
    logit = tl.where(ok, logit, -float("inf"))
    m_new = tl.maximum(m_i, tl.max(logit, axis=0))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet: avoid inf-inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(logit - m_ref)
    acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
    l_i = l_i * alpha + tl.sum(p, axis=0)
    return m_new, l_i, acc


@triton.jit
def _attend_tile(K, V, rows, ok, q, kvh, d, dmask, s_k, s_kh, s_v, s_vh, m_i, l_i, acc):
    """``_load_tile`` then ``_softmax_tile``. Shared by every per-head decode kernel of the
    package (sparse, paged, FP8, cells)."""
    k, v = _load_tile(K, V, rows, ok, kvh, d, dmask, s_k, s_kh, s_v, s_vh)
    return _softmax_tile(k, v, ok, q, m_i, l_i, acc)


@triton.jit
def _store_head(OUT, O_PART, LSE_PART, o, m_i, l_i, b, h, s, d, dmask, s_ob, s_oh,
                D: tl.constexpr, SPLIT: tl.constexpr):
    """A program's result for query head ``h`` of request ``b``: with split-K its normalized
    partial ``o`` and log-sum-exp (``O_PART [B, Hq, S, D]``, ``LSE_PART [B, Hq, S]``, merged by
    ``_decode_reduce_kernel``), else the output row."""
    if SPLIT:
        base = (b * tl.num_programs(1) + h) * tl.num_programs(2) + s
        tl.store(O_PART + base * D + d, o, mask=dmask)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        tl.store(LSE_PART + base, tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf")))
    else:
        tl.store(OUT + b * s_ob + h * s_oh + d, o.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _paged_slots(IDX, REQ_TO_TOKEN, n, stop, req, seq_len, b, h, s_ib, s_ih, s_in, s_rt,
                 PAGE: tl.constexpr, ALIGNED: tl.constexpr):
    """Pool slots of selection entries ``n`` (paged mode) and which are valid. ALIGNED: every
    selected page is one whole pool page (SGLang with ``--page-size PAGE``, as Quest runs), so
    the slot is the page's first slot + ``n % PAGE``: one table entry per page, not per token."""
    live = n < stop
    pid = tl.load(IDX + b * s_ib + h * s_ih + (n // PAGE) * s_in, mask=live, other=-1)
    pos = pid * PAGE + n % PAGE  # positions fit int32
    ok = live & (pid >= 0) & (pos < seq_len)
    if ALIGNED:
        first = tl.load(REQ_TO_TOKEN + req * s_rt + pid * PAGE, mask=ok, other=0).to(tl.int64)
        slot = first + n % PAGE
    else:
        slot = tl.load(REQ_TO_TOKEN + req * s_rt + pos, mask=ok, other=0).to(tl.int64)
    return slot, ok


@triton.jit
def _group_program(REQ_ROWS, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where a GQA decode program (grid ``(B, Hkv, S)``) stands: request ``b``, KV head ``kvh``,
    split ``s`` of ``n_split``, ``hq`` query heads in all, the request's table row ``req``, the
    channels ``d`` (``dmask``: < D) and the query heads ``heads`` of KV head kvh (``hmask``:
    real, not padding). Returns ``(b, kvh, s, n_split, hq, req, d, dmask, hmask, heads)``."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    hq = tl.num_programs(1) * GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    hh = tl.arange(0, BLOCK_H)  # the GROUP query heads of this KV head (rows >= GROUP: padding)
    hmask = hh < GROUP
    heads = kvh * GROUP + hh
    return b, kvh, s, n_split, hq, req, d, dmask, hmask, heads


@triton.jit
def _split_share(n, s, n_split, BLOCK_N: tl.constexpr):
    """Split s's share of ``n`` entries, ``[s*c, min((s+1)*c, n))`` with ``c = cdiv(n, n_split)``
    rounded up to BLOCK_N: returns its ``(start, stop)``."""
    c = tl.cdiv(tl.cdiv(n, n_split), BLOCK_N) * BLOCK_N
    start = s * c
    return start, tl.minimum(start + c, n)


@triton.jit
def _softmax_weights(logit, m_i):
    """A GQA group's query tile against one tile of keys (base-2 logits ``[BLOCK_H, BLOCK_N]``,
    invalid ones -inf), before the online-softmax update: returns ``(p, m_new, alpha)``, the
    tile's weights, the new running maximum and the factor that rescales what came before."""
    m_new = tl.maximum(m_i, tl.max(logit, axis=1))
    m_ref = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing valid yet: avoid inf - inf
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(logit - m_ref[:, None])
    return p, m_new, alpha


@triton.jit
def _group_softmax_step(logit, m_i, l_i, acc):
    """One tile's online-softmax update for a GQA group's query tile (``_softmax_weights``):
    returns ``(p, m_new, l_i, acc)`` with ``acc`` rescaled (the caller adds ``p @ v``). Shared by
    the GQA decode kernels (paged GQA, Palu)."""
    p, m_new, alpha = _softmax_weights(logit, m_i)
    return p, m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def _group_dot_tile(qd, k, v, ok, qk_scale, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One loaded K/V tile of a GQA group's online softmax with ``tl.dot``s: base-2 logits of the
    query tile ``qd`` (``[BLOCK_H, D]``, in the dot operands' dtype) against ``k``, rows not ``ok``
    -inf, then ``p @ v`` added. Returns ``(m_i, l_i, acc)``. Shared by the paged GQA and OmniKV's
    rows + tail kernels."""
    logit = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
    logit = tl.where(ok[None, :], logit, -float("inf"))
    p, m_i, l_i, acc = _group_softmax_step(logit, m_i, l_i, acc)
    acc += tl.dot(p.to(qd.dtype), v.to(qd.dtype), input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _residual_tile(K, REQ_TO_TOKEN, qd, n0, r1, req, kvh, d, dmask, s_ks, s_kh, s_rt, PRECISION: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Residual rows ``[n0, n0 + BLOCK_N)`` (those < ``r1``) of a GQA program: row j at slot
    ``req_to_token[req, j]`` of the token-major pool. Returns the base-2 logits of the query tile
    ``qd`` against their keys (``[BLOCK_H, BLOCK_N]``, -inf past r1; dots in qd's dtype), their
    slots and the mask of their ``[BLOCK_N, BLOCK_D]`` tiles, for the caller's value load. Shared by
    the residual loops of KIVI, TurboQuant and Palu; each keeps its own online-softmax update
    (KIVI rescales after the value load, the others before: the order shows in the compiled code)."""
    n = n0 + tl.arange(0, BLOCK_N)
    ok = n < r1
    slot = tl.load(REQ_TO_TOKEN + req * s_rt + n, mask=ok, other=0).to(tl.int64)
    row_mask = ok[:, None] & dmask[None, :]
    k = tl.load(K + slot[:, None] * s_ks + kvh * s_kh + d[None, :], mask=row_mask, other=0.0)
    logit = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=PRECISION)  # [BLOCK_H, BLOCK_N]
    return tl.where(ok[None, :], logit, -float("inf")), slot, row_mask


@triton.jit
def _store_group(OUT, O_PART, LSE_PART, acc, m_i, l_i, b, heads, hmask, s, d, dmask, s_ob, s_oh, hq, n_split,
                 D: tl.constexpr, SPLIT: tl.constexpr):
    """A GQA program's result for its query heads ``heads`` (``hmask``: real, not padding): with
    split-K the normalized partials and log-sum-exps in ``_store_head``'s layout, else the
    output rows. A head with nothing read stores zeros."""
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    omask = hmask[:, None] & dmask[None, :]
    if SPLIT:
        base = (b * hq + heads) * n_split + s  # O_PART [B, Hq, S, D], LSE [B, Hq, S]
        tl.store(O_PART + base[:, None] * D + d[None, :], o, mask=omask)
        tl.store(LSE_PART + base, tl.where(l_i > 0, m_i + tl.log2(l_safe), -float("inf")), mask=hmask)
    else:
        tl.store(OUT + b * s_ob + heads[:, None] * s_oh + d[None, :], o.to(OUT.dtype.element_ty), mask=omask)


@triton.jit
def _decode_partial_kernel(
    Q, K, V, REQ_TO_TOKEN, REQ_ROWS, IDX, VALID, SEQ_LENS, OUT, O_PART, LSE_PART,
    qk_scale, N, chunk,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_rt,
    s_ib, s_ih, s_in, s_mb, s_mh, s_mn, s_ob, s_oh,
    GROUP: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr, SPLIT: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr = False, ALIGNED: tl.constexpr = False, NUM_STAGES: tl.constexpr = 0,
):
    """PREFETCH (paged mode): the next tile's page ids are loaded before this tile's keys and
    values, and its slots resolved while they are in flight, so a tile waits on one load chain
    instead of three (ids -> table -> KV). NUM_STAGES > 0: Triton's loop pipelining at that depth
    (``tl.range(num_stages=)``); 0 a plain loop."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    # qk_scale = softmax scale * log2(e): logits are in base 2, exp2 below
    q = (tl.load(Q + b * s_qb + h * s_qh + d, mask=dmask, other=0.0).to(tl.float32) * qk_scale).to(tl.float32)
    seq_len = 0
    if PAGED:
        seq_len = tl.load(SEQ_LENS + b)

    start = s * chunk
    stop = tl.minimum(start + chunk, N)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if PAGED and PREFETCH:
        slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, start + tl.arange(0, BLOCK_N), stop, req, seq_len, b, h,
                                s_ib, s_ih, s_in, s_rt, PAGE, ALIGNED)
        for n0 in range(start, stop, BLOCK_N):
            k, v = _load_tile(K, V, slot, ok, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh)
            cur_ok = ok
            slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, n0 + BLOCK_N + tl.arange(0, BLOCK_N), stop, req, seq_len,
                                    b, h, s_ib, s_ih, s_in, s_rt, PAGE, ALIGNED)
            m_i, l_i, acc = _softmax_tile(k, v, cur_ok, q, m_i, l_i, acc)
    else:
        for n0 in tl.range(start, stop, BLOCK_N, num_stages=NUM_STAGES if NUM_STAGES > 0 else None):
            n = n0 + tl.arange(0, BLOCK_N)
            if PAGED:
                slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, n, stop, req, seq_len, b, h, s_ib, s_ih, s_in, s_rt,
                                        PAGE, ALIGNED)
            else:
                live = n < stop
                pos = tl.load(IDX + b * s_ib + h * s_ih + n * s_in, mask=live, other=0).to(tl.int64)
                ok = live & (tl.load(VALID + b * s_mb + h * s_mh + n * s_mn, mask=live, other=0) != 0)
                slot = tl.load(REQ_TO_TOKEN + req * s_rt + pos, mask=ok, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_tile(K, V, slot, ok, q, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh, m_i, l_i, acc)

    o = acc / tl.where(l_i > 0, l_i, 1.0)  # a head (or split) with no valid entry: acc = 0 -> zeros
    _store_head(OUT, O_PART, LSE_PART, o, m_i, l_i, b, h, s, d, dmask, s_ob, s_oh, D, SPLIT)


@triton.jit
def _decode_reduce_kernel(
    O_PART, LSE_PART, OUT, S, s_ob, s_oh,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """out[b, h] = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); empty splits have lse = -inf."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h) * S
    si = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = si < S
    lse = tl.load(LSE_PART + base + si, mask=smask, other=-float("inf"))
    mx = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(mx == -float("inf"), 0.0, mx))
    o = tl.load(O_PART + (base + si[:, None]) * D + d[None, :],
                mask=smask[:, None] & (d[None, :] < D), other=0.0)
    den = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0, den, 1.0)
    tl.store(OUT + b * s_ob + h * s_oh + d, out.to(OUT.dtype.element_ty), mask=d < D)


def split_buffers(out: torch.Tensor, splits: int):
    """Split-K partials of every decode kernel of this package: ``O_PART [B, Hq, S, D]`` and
    ``LSE_PART [B, Hq, S]`` (fp32); with one split the kernel writes ``out`` directly and both
    are placeholders."""
    if splits <= 1:
        return out, out
    b, hq, d = out.shape
    return (torch.empty(b, hq, splits, d, dtype=torch.float32, device=out.device),
            torch.empty(b, hq, splits, dtype=torch.float32, device=out.device))


def merge_splits(o_part, lse_part, out: torch.Tensor, splits: int) -> torch.Tensor:
    """``_decode_reduce_kernel`` over the partials of ``split_buffers`` (nothing with one split)."""
    if splits > 1:
        b, hq, d = out.shape
        _decode_reduce_kernel[(b, hq)](
            o_part, lse_part, out, splits, out.stride(0), out.stride(1),
            D=d, BLOCK_D=pow2(d, 16), BLOCK_S=pow2(splits), num_warps=4,
        )
    return out


def plan_splits(programs, n_total, d, device, block_n=None, num_splits=None):
    """(block_n, num_splits, chunk): entries ``[s*chunk, (s+1)*chunk)`` go to split s.
    ``programs`` = B * Hq. Default: enough splits for ~4 programs per SM, each split at least
    two blocks, at most 64 splits; no empty trailing split."""
    if block_n is None:  # 32 x 128 tiles: no register spills in fp16/bf16/fp32 (compile_report)
        block_n = 32 if pow2(d, 16) <= 128 else 16
    n_blocks = triton.cdiv(max(n_total, 1), block_n)
    if num_splits is None:
        want = triton.cdiv(4 * num_sms(device), max(programs, 1))
        num_splits = max(1, min(want, triton.cdiv(n_blocks, 2), 64))
    chunk = triton.cdiv(n_blocks, num_splits) * block_n
    return block_n, max(1, triton.cdiv(n_total, chunk)), chunk


def _launch(q, k_cache, v_cache, req_to_token, req_rows, idx, valid, seq_lens, page, paged,
            n_total, scale, num_splits, block_n, num_warps=None, prefetch=False, aligned=False, num_stages=0):
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    check_rows(q, k_cache, v_cache)
    check_device(req_to_token, req_rows, idx)
    check_table(req_to_token)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    block_d = pow2(d, 16)
    block_n, num_splits, chunk = plan_splits(b * hq, n_total, d, q.device, block_n, num_splits)
    split = num_splits > 1
    o_part, lse_part = split_buffers(out, num_splits)
    if valid is None:
        valid, vstr = idx, (0, 0, 0)  # unused in paged mode
    else:
        valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
        vstr = valid.stride()
    if seq_lens is None:
        seq_lens = req_rows  # unused in rows mode
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _decode_partial_kernel[(b, hq, num_splits)](
        q, k_cache, v_cache, req_to_token, req_rows, idx, valid, seq_lens, out, o_part, lse_part,
        scale * LOG2E, n_total, chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), req_to_token.stride(0),
        idx.stride(0), idx.stride(1), idx.stride(2), *vstr, out.stride(0), out.stride(1),
        GROUP=hq // hkv, PAGE=page, PAGED=paged, SPLIT=split,
        D=d, BLOCK_D=block_d, BLOCK_N=block_n, PREFETCH=bool(prefetch and paged),
        ALIGNED=bool(aligned and paged), NUM_STAGES=int(num_stages or 0), num_warps=int(num_warps or 4),
    )
    return merge_splits(o_part, lse_part, out, num_splits)


def sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, rows, valid,
                            scale=None, num_splits=None, block_n=None):
    """Triton version of ``reference.sparse_decode_attention`` (rows ``[B, Hq, N]`` + valid)."""
    if rows.shape != valid.shape or rows.shape[:2] != q.shape[:2]:
        raise ValueError(f"rows {tuple(rows.shape)} / valid {tuple(valid.shape)} "
                         f"vs q {tuple(q.shape)}")
    return _launch(q, k_cache, v_cache, req_to_token, req_rows, rows, valid, None, 1, False,
                   rows.shape[2], scale, num_splits, block_n)


def paged_sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, page_ids,
                                  seq_lens, page, scale=None, num_splits=None, block_n=None,
                                  num_warps=None, prefetch=None, aligned=False, num_stages=None):
    """Triton version of ``reference.paged_sparse_decode_attention`` (page_ids ``[B, Hq, P]``,
    ``-1`` = padding; positions ``>= seq_lens[b]`` masked).

    ``aligned=True`` promises that every row-page is one whole, aligned pool page (the engine
    allocates KV in pages of ``page`` slots, as Quest runs SGLang): the kernel then reads one
    table entry per page. Launch options left ``None`` (``num_splits``, ``block_n``,
    ``num_warps``, ``prefetch``, ``num_stages``) come from the device's tuning table
    (``tuning.py``), else the built-in heuristics. ``prefetch`` is a hand-written pipeline of its
    own: with it ``num_stages`` is not used."""
    if page_ids.shape[:2] != q.shape[:2]:
        raise ValueError(f"page_ids {tuple(page_ids.shape)} vs q {tuple(q.shape)}")
    check_device(seq_lens)
    cfg = tuning.fill("paged_sparse_decode_attention", q.shape[0], q.device, num_splits=num_splits,
                      block_n=block_n, num_warps=num_warps, prefetch=prefetch, num_stages=num_stages)
    return _launch(q, k_cache, v_cache, req_to_token, req_rows, page_ids, None, seq_lens,
                   int(page), True, page_ids.shape[2] * int(page), scale, cfg["num_splits"], cfg["block_n"],
                   cfg["num_warps"], cfg["prefetch"], aligned, cfg["num_stages"])
