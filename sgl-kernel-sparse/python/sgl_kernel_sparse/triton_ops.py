"""All Triton entry points (needs triton; import it after setting TRITON_INTERPRET if wanted)."""

from .triton_attn_sums import attention_sums
from .triton_cells import cells_decode_attention
from .triton_compact import compact_kv
from .triton_decode import paged_sparse_decode_attention, sparse_decode_attention
from .triton_decode_scores import decode_attention_add
from .triton_kvzip import kvzip_probe_scores
from .triton_paged_gqa import paged_gqa_decode_attention
from .triton_omnikv import rows_tail_decode_attention, token_logits
from .triton_rkv import rkv_redundancy_layers, rkv_redundancy_rows
from .triton_quest import quest_fold_decode_keys, quest_page_scores, quest_page_scores_paged
from .triton_select import select_top
from .triton_snapkv import snapkv_window_scores

__all__ = [
    "attention_sums",
    "cells_decode_attention",
    "compact_kv",
    "decode_attention_add",
    "kvzip_probe_scores",
    "paged_gqa_decode_attention",
    "paged_sparse_decode_attention",
    "quest_fold_decode_keys",
    "quest_page_scores",
    "quest_page_scores_paged",
    "rkv_redundancy_layers",
    "rkv_redundancy_rows",
    "rows_tail_decode_attention",
    "select_top",
    "snapkv_window_scores",
    "sparse_decode_attention",
    "token_logits",
]
