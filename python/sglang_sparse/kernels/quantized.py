"""Decode over a quantized history + full-precision residual (KIVI): the Triton kernel of
``sgl_kernel_sparse.triton_kivi`` on CUDA tensors, its plain-torch reference
(``sgl_kernel_sparse.quant``) elsewhere. Dequantization happens inside the kernel: no
full-precision copy of the history is made."""

from __future__ import annotations

import sgl_kernel_sparse
from sgl_kernel_sparse import quant


def kivi_decode(q, store, layer: int, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
                res_len, scale: float):
    args = (q, *store.layer(layer), block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
            res_len, store.bits, store.group, scale)
    if sgl_kernel_sparse.use_triton(q, k_cache, block_table):
        from sgl_kernel_sparse.triton_kivi import kivi_decode_attention

        return kivi_decode_attention(*args)
    return quant.kivi_decode_attention(*args)
