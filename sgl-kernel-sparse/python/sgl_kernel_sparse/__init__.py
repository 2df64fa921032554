"""sgl_kernel_sparse: kernels for sparse KV-cache methods on SGLang's token-major KV pool.

Public functions dispatch to Triton on CUDA tensors and to the plain-torch references
(``sgl_kernel_sparse.reference``) otherwise; ``sgl_kernel_sparse.triton_ops`` calls Triton
directly. See README.md for shapes and index conventions.
"""

from . import reference
from .reference import pyramid_budgets
from .dispatch import (
    attention_sums,
    cells_decode_attention,
    compact_kv,
    decode_attention_add,
    kvzip_probe_scores,
    paged_gqa_decode_attention,
    paged_sparse_decode_attention,
    quest_fold_decode_keys,
    quest_page_scores,
    quest_page_scores_paged,
    quest_select_pages,
    rkv_redundancy_layers,
    rkv_redundancy_rows,
    rows_tail_decode_attention,
    snapkv_keep_indices,
    snapkv_select,
    snapkv_window_scores,
    sparse_decode_attention,
    stable_topk,
    token_logits,
    use_triton,
)

__version__ = "0.1.0"

__all__ = [
    "attention_sums",
    "cells_decode_attention",
    "compact_kv",
    "decode_attention_add",
    "kvzip_probe_scores",
    "paged_gqa_decode_attention",
    "paged_sparse_decode_attention",
    "pyramid_budgets",
    "quest_fold_decode_keys",
    "quest_page_scores",
    "quest_page_scores_paged",
    "quest_select_pages",
    "rkv_redundancy_layers",
    "rkv_redundancy_rows",
    "rows_tail_decode_attention",
    "snapkv_keep_indices",
    "reference",
    "snapkv_select",
    "snapkv_window_scores",
    "sparse_decode_attention",
    "stable_topk",
    "token_logits",
    "use_triton",
]
