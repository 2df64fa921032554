"""Decode over a quantized history + full-precision residual (KIVI, TurboQuant, Palu): the Triton
kernels of ``sgl_kernel_sparse.triton_kivi`` / ``triton_turboquant`` on CUDA tensors (unless
``SGL_KERNEL_SPARSE_BACKEND=reference``), the plain-torch references
(``sgl_kernel_sparse.quant``, ``sgl_kernel_sparse.turboquant``) elsewhere. Dequantization happens
inside the kernel: no full-precision copy of the history is made (Palu, which has no GPU kernel
yet, reconstructs each request's blocks in its plain-torch reference on every device).
``quantized_decode`` picks the kernel by the store's ``codec``."""

from __future__ import annotations

import sgl_kernel_sparse
from sgl_kernel_sparse import palu, quant, turboquant


def kivi_decode(q, store, layer: int, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
                res_len, scale: float):
    args = (q, *store.layer(layer), block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
            res_len, store.bits, store.group, scale)
    if sgl_kernel_sparse.use_triton(q, k_cache, block_table):
        from sgl_kernel_sparse.triton_kivi import kivi_decode_attention

        return kivi_decode_attention(*args)
    return quant.kivi_decode_attention(*args)


def turboquant_decode(q, store, layer: int, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
                      res_len, scale: float):
    """Keys and values share the store's rotation and codebook."""
    k_codes, k_norm, v_codes, v_norm = store.layer(layer)
    args = (q, k_codes, k_norm, v_codes, v_norm, store.rot, store.centroids, store.centroids, block_table,
            req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len, store.bits, scale)
    if sgl_kernel_sparse.use_triton(q, k_cache, block_table):
        from sgl_kernel_sparse.triton_turboquant import turboquant_decode_attention

        return turboquant_decode_attention(*args)
    return turboquant.turboquant_decode_attention(*args)


def palu_decode(q, store, layer: int, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len,
                scale: float):
    """Latent blocks (``core/latent_store``) reconstructed with the store's factors and RoPE
    table, then attention with the residual rows (plain torch; eager only)."""
    f, lat_k, lat_v = store.factors, *store.layer(layer)
    return palu.palu_decode_attention(q, lat_k, lat_v, f.bk[layer], f.bv[layer], f.bias_k[layer], f.bias_v[layer],
                                      store.rope.cos_sin, store.rope.neox, block_table, req_rows, n_blocks, k_cache,
                                      v_cache, req_to_token, res_len, scale)


DECODERS = {"kivi": kivi_decode, "turboquant": turboquant_decode, "palu": palu_decode}


def quantized_decode(q, store, *args):
    return DECODERS[store.codec](q, store, *args)
