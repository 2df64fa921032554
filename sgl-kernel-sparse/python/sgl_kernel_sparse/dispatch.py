"""Backend choice: the Triton kernel when every tensor argument is on CUDA and triton imports,
the plain-torch reference otherwise (CPU, or ``SGL_KERNEL_SPARSE_BACKEND=reference``).
Extra keyword arguments (``num_splits``, ``block_n``, ``max_pages``, ...) go to Triton only."""

from __future__ import annotations

import os

import torch

from . import eviction_scores, reference


_TRITON: list = []  # [module or None] once loaded (a plain list: torch.compile traces reads of it)


def _triton_ops():
    if not _TRITON:
        try:
            from . import triton_ops
        except ImportError:  # triton is optional
            triton_ops = None
        _TRITON.append(triton_ops)
    return _TRITON[0]


def use_triton(*args) -> bool:
    if os.environ.get("SGL_KERNEL_SPARSE_BACKEND", "") == "reference":
        return False
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    # len(), not bool(list): torch.compile traces this inside the decode forward
    return len(tensors) > 0 and all(t.is_cuda for t in tensors) and _triton_ops() is not None


def _pick(name, args, kwargs):
    if use_triton(*args, *kwargs.values()):
        return getattr(_triton_ops(), name)(*args, **kwargs)
    ref_kwargs = {k: v for k, v in kwargs.items() if k in _REF_KWARGS.get(name, ())}
    return getattr(reference, name)(*args, **ref_kwargs)


_REF_KWARGS = {
    "sparse_decode_attention": ("scale",),
    "paged_sparse_decode_attention": ("scale",),
    "paged_gqa_decode_attention": ("scale",),
    "cells_decode_attention": ("scale",),
    "rows_tail_decode_attention": ("scale",),
    "token_logits": ("scale",),
    "quest_page_scores": ("summary_rows",),
    "quest_page_scores_paged": (),
    "snapkv_window_scores": ("scale", "slots"),
    "compact_kv": (),
}


def sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, rows, valid,
                            scale=None, **triton_kwargs):
    return _pick("sparse_decode_attention",
                 (q, k_cache, v_cache, req_to_token, req_rows, rows, valid),
                 dict(scale=scale, **triton_kwargs))


def paged_sparse_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, page_ids,
                                  seq_lens, page, scale=None, **triton_kwargs):
    return _pick("paged_sparse_decode_attention",
                 (q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, page),
                 dict(scale=scale, **triton_kwargs))


def paged_gqa_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, page_ids,
                               seq_lens, page, scale=None, **triton_kwargs):
    return _pick("paged_gqa_decode_attention",
                 (q, k_cache, v_cache, req_to_token, req_rows, page_ids, seq_lens, page),
                 dict(scale=scale, **triton_kwargs))


def rows_tail_decode_attention(q, k_cache, v_cache, req_to_token, req_rows, sel_rows, tail_start, seq_lens,
                               scale=None, **triton_kwargs):
    return _pick("rows_tail_decode_attention",
                 (q, k_cache, v_cache, req_to_token, req_rows, sel_rows, tail_start, seq_lens),
                 dict(scale=scale, **triton_kwargs))


def token_logits(q, k_cache, req_to_token, req_rows, seq_lens, scale=None, **triton_kwargs):
    return _pick("token_logits", (q, k_cache, req_to_token, req_rows, seq_lens),
                 dict(scale=scale, **triton_kwargs))


def cells_decode_attention(q, flat_k, flat_v, req_to_token, req_rows, seq_lens, entries, offset, count,
                           packed_rows, layer, slots_per_layer, scale=None, **triton_kwargs):
    return _pick("cells_decode_attention",
                 (q, flat_k, flat_v, req_to_token, req_rows, seq_lens, entries, offset, count, packed_rows,
                  layer, slots_per_layer),
                 dict(scale=scale, **triton_kwargs))


def quest_page_scores(q, kmin, kmax, n_pages, summary_rows=None, **triton_kwargs):
    return _pick("quest_page_scores", (q, kmin, kmax, n_pages),
                 dict(summary_rows=summary_rows, **triton_kwargs))


def quest_page_scores_paged(q, kmin, kmax, req_to_token, req_rows, n_pages, page, **triton_kwargs):
    return _pick("quest_page_scores_paged", (q, kmin, kmax, req_to_token, req_rows, n_pages, page),
                 dict(triton_kwargs))


def snapkv_window_scores(q_win, k, scale=None, slots=None, **triton_kwargs):
    return _pick("snapkv_window_scores", (q_win, k),
                 dict(scale=scale, slots=slots, **triton_kwargs))


def compact_kv(k_cache, v_cache, src_slots, dst_slots, **triton_kwargs):
    return _pick("compact_kv", (k_cache, v_cache, src_slots, dst_slots), dict(triton_kwargs))


def snapkv_keep_indices(q_win, k, budget, window, kernel, scale=None, slots=None, sinks=0, recent=0):
    """``reference.snapkv_keep_indices`` with the window scores on Triton for CUDA tensors (the
    keys read from the pool through ``slots``), the selection in torch."""
    return reference.snapkv_keep_indices(q_win, k, budget, window, kernel, scale=scale, slots=slots,
                                         window_scores=snapkv_window_scores, sinks=sinks, recent=recent)


def quest_select_pages(scores, n_sel):
    """``reference.quest_select_pages`` as int64: one Triton program per row for CUDA scores and
    an int ``n_sel`` (``triton_select``: same indices, same tie rule), the stable sort otherwise."""
    if isinstance(n_sel, int) and use_triton(scores):
        return _triton_ops().select_top(scores, n_sel)
    return reference.quest_select_pages(scores, n_sel).long()


def quest_fold_decode_keys(kmin, kmax, k, slots, page):
    """``reference.quest_fold_keys`` for decode steps (every token in its own page): one Triton
    launch on CUDA (``triton_quest.quest_fold_decode_keys``), the reference scatter elsewhere."""
    if use_triton(kmin, kmax, k, slots):
        return _triton_ops().quest_fold_decode_keys(kmin, kmax, k, slots, page)
    return reference.quest_fold_keys(kmin, kmax, k, slots, page)


def kvzip_probe_scores(q_probe, keys, q_positions, context_len, scale=None, query_block=256):
    """``reference.kvzip_probe_scores``: on CUDA the two-pass Triton kernel (``triton_kvzip``,
    nothing of size ``S x N`` in memory); elsewhere the reference over ``query_block`` probe
    queries at a time (memory ``Hq x query_block x N`` fp32), combined by ``torch.maximum``."""
    if use_triton(q_probe, keys, q_positions):
        return _triton_ops().kvzip_probe_scores(q_probe, keys, q_positions, context_len, scale=scale)
    best = None
    for lo in range(0, q_probe.shape[0], query_block):
        s = reference.kvzip_probe_scores(q_probe[lo: lo + query_block], keys,
                                         q_positions[lo: lo + query_block], context_len, scale)
        best = s if best is None else torch.maximum(best, s)
    return best


def attention_sums(q, keys, q_rows, scale=None, weights=None, **triton_kwargs):
    """``eviction_scores.attention_sums`` (accumulated causal attention per key, ``[Hkv, N]``): on
    CUDA the two-pass Triton kernel (``triton_attn_sums``, nothing of size ``S x N`` in memory);
    elsewhere the reference over blocks of queries (Triton-only keyword arguments, e.g.
    ``check_rows_range``, are dropped there). fp8 keys (an fp8 KV cache) are converted to q's
    dtype inside the kernel, other 16/32-bit keys (e.g. ``--kv-cache-dtype bf16`` under an fp16
    model) here, as the reference's fp32 upcast does."""
    if use_triton(q, keys, q_rows):
        if keys.dtype != q.dtype and keys.dtype.is_floating_point and keys.element_size() > 1:
            keys = keys.to(q.dtype)
        return _triton_ops().attention_sums(q, keys, q_rows, scale=scale, weights=weights, **triton_kwargs)
    return eviction_scores.attention_sums(q, keys, q_rows, scale=scale, weights=weights)


def decode_attention_add(scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots, weight=None, scale=None,
                         **triton_kwargs):
    """``eviction_scores.decode_attention_add`` (in place: a decode step's attention added to the
    per-slot scores of one layer): on CUDA the Triton kernel (``triton_decode_scores``: queries of
    weight 0 read nothing; no ``[B, Hq, W]`` softmax in torch, no atomics), elsewhere the reference."""
    args = (scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots)
    if use_triton(*args):
        return _triton_ops().decode_attention_add(*args, weight=weight, scale=scale, **triton_kwargs)
    return eviction_scores.decode_attention_add(*args, weight=weight, scale=scale)


def rkv_redundancy_rows(k_cache, slots, **triton_kwargs):
    """``eviction_scores.rkv_redundancy_rows``: on CUDA the Triton kernel (``triton_rkv``: keys
    read from the pool through the slots, never gathered or copied to fp32), elsewhere the
    reference."""
    if use_triton(k_cache, slots):
        return _triton_ops().rkv_redundancy_rows(k_cache, slots, **triton_kwargs)
    return eviction_scores.rkv_redundancy_rows(k_cache, slots)


def rkv_redundancy_layers(flat_k, slots, num_layers, **triton_kwargs):
    """``eviction_scores.rkv_redundancy_layers``: on CUDA one Triton launch over every layer of the
    flat pool (``triton_rkv``), elsewhere the reference, layer by layer."""
    if use_triton(flat_k, slots):
        return _triton_ops().rkv_redundancy_layers(flat_k, slots, num_layers, **triton_kwargs)
    return eviction_scores.rkv_redundancy_layers(flat_k, slots, num_layers)


# Other selections stay in torch on every device (stable sorts: ties -> lower index).
snapkv_select = reference.snapkv_select
stable_topk = reference.stable_topk
