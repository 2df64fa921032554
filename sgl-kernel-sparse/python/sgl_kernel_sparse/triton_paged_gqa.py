"""Paged sparse decode attention with one page set per KV head (Quest ``--sparse-select-per kv_head``).

Grid ``(B, Hkv, S)``: program (b, g, s) serves the GROUP query heads of KV head g, so each selected
K/V tile is loaded once for all of them (a per-query-head kernel loads it GROUP times) and both
products are ``tl.dot``s over a ``[BLOCK_H >= 16, D]`` query tile (rows past GROUP are padding).
It walks entries ``[s*chunk, min((s+1)*chunk, N))`` of KV head g's selection, ``N = P * PAGE``;
entry n is position ``page_ids[b, g, n // PAGE] * PAGE + n % PAGE`` (``-1`` pages and positions
``>= seq_lens[b]`` masked), its slot ``req_to_token[req_rows[b], position]`` (``aligned``: the
page's first slot + ``n % PAGE``, as ``triton_decode._paged_slots``). Online softmax in fp32,
base 2; split-K partials merged by ``triton_decode._decode_reduce_kernel``. fp16 / bf16 dot in
their own dtype with fp32 accumulation; fp32 uses 3xTF32 (about fp32 accuracy).

A tile waits on three dependent loads (page ids -> slot table -> K/V). ``PREFETCH`` resolves the
next tile's slots while this tile's K/V are in flight, so a tile waits on one load; without it, a
plain loop that Triton may pipeline (``NUM_STAGES``). (Issuing the next tile's K/V loads ahead as
well, two tiles in flight per program, measured slower at every shape on an H100: 2026-12-06.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning
from .triton_common import check_device, check_gqa, check_rows, check_table, pow2
from .triton_decode import (LOG2E, _group_dot_tile, _load_tile, _paged_slots, _store_group, merge_splits,
                            plan_splits, split_buffers)


@triton.jit
def _paged_gqa_partial_kernel(
    Q, K, V, REQ_TO_TOKEN, REQ_ROWS, IDX, SEQ_LENS, OUT, O_PART, LSE_PART, qk_scale, N, chunk,
    s_qb, s_qh, s_ks, s_kh, s_vs, s_vh, s_rt, s_ib, s_ih, s_in, s_ob, s_oh,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, ALIGNED: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, DOT16: tl.constexpr, NUM_STAGES: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    # triton_decode._group_program's prologue written out: called, it moves the seq_len load
    # below the index arithmetic and reorders the PTX of the kernel Quest's figures were measured on
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    n_split = tl.num_programs(2)
    hq = tl.num_programs(1) * GROUP
    req = tl.load(REQ_ROWS + b).to(tl.int64)
    seq_len = tl.load(SEQ_LENS + b)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < GROUP
    heads = kvh * GROUP + hh
    # the dot takes q as stored (no second rounding of a scaled copy); its fp32 logits are then
    # scaled by qk_scale = softmax scale * log2(e): logits are in base 2, exp2 below
    q = tl.load(Q + b * s_qb + heads[:, None] * s_qh + d[None, :], mask=hmask[:, None] & dmask[None, :], other=0.0)
    DT = Q.dtype.element_ty if DOT16 else tl.float32  # dot operands (accumulation is fp32)
    qd = q.to(DT)
    m_i = tl.full([BLOCK_H], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    start = s * chunk
    stop = tl.minimum(start + chunk, N)
    if PREFETCH:
        slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, start + tl.arange(0, BLOCK_N), stop, req, seq_len, b, kvh,
                                s_ib, s_ih, s_in, s_rt, PAGE, ALIGNED)
        for n0 in range(start, stop, BLOCK_N):
            k, v = _load_tile(K, V, slot, ok, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh)
            cur_ok = ok  # the next tile's slots are resolved while k / v load
            slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, n0 + BLOCK_N + tl.arange(0, BLOCK_N), stop, req, seq_len,
                                    b, kvh, s_ib, s_ih, s_in, s_rt, PAGE, ALIGNED)
            m_i, l_i, acc = _group_dot_tile(qd, k, v, cur_ok, qk_scale, m_i, l_i, acc, PRECISION)
    else:
        for n0 in tl.range(start, stop, BLOCK_N, num_stages=NUM_STAGES if NUM_STAGES > 0 else None):
            slot, ok = _paged_slots(IDX, REQ_TO_TOKEN, n0 + tl.arange(0, BLOCK_N), stop, req, seq_len, b, kvh,
                                    s_ib, s_ih, s_in, s_rt, PAGE, ALIGNED)
            k, v = _load_tile(K, V, slot, ok, kvh, d, dmask, s_ks, s_kh, s_vs, s_vh)
            m_i, l_i, acc = _group_dot_tile(qd, k, v, ok, qk_scale, m_i, l_i, acc, PRECISION)
    _store_group(OUT, O_PART, LSE_PART, acc, m_i, l_i, b, heads, hmask, s, d, dmask, s_ob, s_oh, hq, n_split,
                 D, SPLIT)


def paged_gqa_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, page,
                               scale=None, num_splits=None, block_n=None, num_warps=None, num_stages=None,
                               aligned=False, dot16=None, prefetch=None):
    """Triton version of ``reference.paged_gqa_decode_attention`` (page_ids ``[B, Hkv, P]``, ``-1`` =
    padding; every query head reads its KV head's pages). ``aligned`` as in
    ``triton_decode.paged_sparse_decode_attention``; launch options left ``None`` come from the
    device's tuning table (``tuning.py``, kernel ``paged_gqa_decode_attention``). ``prefetch`` (default
    on unless ``num_stages`` is given: as fast at 128K, 10% faster at 32 x 32K on an H100): the next
    tile's slots resolved ahead, a pipeline of its own: ``num_stages`` is then unused. No host sync."""
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    check_gqa(hq, hkv)
    if page_ids.shape[:2] != (b, hkv):
        raise ValueError(f"page_ids {tuple(page_ids.shape)} must be [B, Hkv, P] = [{b}, {hkv}, P]")
    check_rows(q, k_cache, v_cache)
    check_device(req_to_token, req_rows, page_ids, seq_lens)
    check_table(req_to_token)
    out = torch.empty_like(q)
    if b == 0 or hq == 0:
        return out
    cfg = tuning.fill("paged_gqa_decode_attention", b, q.device, num_splits=num_splits, block_n=block_n,
                      num_warps=num_warps, num_stages=num_stages, prefetch=prefetch)
    n_total = page_ids.shape[2] * int(page)
    want_n = max(16, cfg["block_n"]) if cfg["block_n"] else None  # a tl.dot dimension
    block_n, splits, chunk = plan_splits(b * hkv, n_total, d, q.device, want_n, cfg["num_splits"])
    fp32 = q.dtype == torch.float32
    if dot16 is None:  # Triton's CPU interpreter casts to bf16 by bits (wrong dots): fp32 there
        dot16 = not fp32 and (q.is_cuda or q.dtype != torch.bfloat16)
    o_part, lse_part = split_buffers(out, splits)
    # prefetch left unset: on, unless Triton's pipelining was asked for
    pre = cfg["prefetch"] if cfg["prefetch"] is not None else not cfg["num_stages"]
    scale = (1.0 / d**0.5) if scale is None else float(scale)
    _paged_gqa_partial_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, out, o_part, lse_part,
        scale * LOG2E, n_total, chunk,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        req_to_token.stride(0), page_ids.stride(0), page_ids.stride(1), page_ids.stride(2),
        out.stride(0), out.stride(1),
        GROUP=hq // hkv, BLOCK_H=pow2(hq // hkv, 16), PAGE=int(page), ALIGNED=bool(aligned), SPLIT=splits > 1,
        PRECISION="tf32x3" if fp32 else "tf32", DOT16=bool(dot16) and not fp32,
        NUM_STAGES=int(cfg["num_stages"] or 0), D=d, BLOCK_D=pow2(d, 16), BLOCK_N=block_n,
        PREFETCH=bool(pre),
        num_warps=int(cfg["num_warps"] or 4),
    )
    return merge_splits(o_part, lse_part, out, splits)

