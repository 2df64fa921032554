"""Decode over a quantized history + full-precision residual (KIVI, TurboQuant, Palu): the Triton
kernels of ``sgl_kernel_sparse.triton_kivi`` / ``triton_turboquant`` / ``triton_palu`` on CUDA
tensors (unless ``SGL_KERNEL_SPARSE_BACKEND=reference``), the plain-torch references
(``sgl_kernel_sparse.quant``, ``sgl_kernel_sparse.turboquant``, ``sgl_kernel_sparse.palu``)
elsewhere. Dequantization (Palu: reconstruction from the latents, RoPE included) happens inside
the kernel: no full-precision copy of the history is made (the references do make one).
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
    table, then attention with the residual rows: keys rebuilt and rotated in registers, values
    summed in the latent space (``triton_palu``) on CUDA, else the plain-torch reference."""
    f, lat_k, lat_v = store.factors, *store.layer(layer)
    args = (q, lat_k, lat_v, f.bk[layer], f.bv[layer], f.bias_k[layer], f.bias_v[layer], store.rope.cos_sin,
            store.rope.neox, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len, scale)
    if sgl_kernel_sparse.use_triton(q, k_cache, block_table):
        from sgl_kernel_sparse.triton_palu import palu_decode_attention

        return palu_decode_attention(*args)
    return palu.palu_decode_attention(*args)


def deltakv_decode(q, store, layer: int, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len,
                   scale: float):
    """DeltaKV blocks (``core/delta_store``) reconstructed with the store's compressor and RoPE
    table, then attention with the residual rows (plain torch; eager only)."""
    from sgl_kernel_sparse.deltakv import deltakv_decode_attention

    c, (codes, fathers, refs) = store.compressor, store.layer(layer)
    return deltakv_decode_attention(q, codes, fathers, refs, c.up[layer], c.b_up[layer], store.rope.cos_sin,
                                    store.rope.neox, block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token,
                                    res_len, scale)


DECODERS = {"kivi": kivi_decode, "turboquant": turboquant_decode, "palu": palu_decode, "deltakv": deltakv_decode}


def quantized_decode(q, store, *args):
    return DECODERS[store.codec](q, store, *args)
