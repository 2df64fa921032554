"""Block-sparse prefill attention (FlashPrefill, issue 17): the Triton kernel of
``sgl_kernel_sparse.triton_flashprefill`` on CUDA tensors, the plain-torch reference
(``sgl_kernel_sparse.flashprefill``) elsewhere. The block mask is computed in torch on every
device. Called by ``methods/flashprefill.py`` (``--sparse-prefill flashprefill``).

Shapes (one request, one layer): a chunk ``q [s, Hq, D]`` at absolute positions
``[start, start + s)`` over ``k / v [start + s, Hkv, D]``; the mask ``[Hq, n_qb, n_kb]`` over
blocks aligned to absolute positions (``sgl_kernel_sparse.flashprefill``'s docstring)."""

from __future__ import annotations

import sgl_kernel_sparse
import torch
from sgl_kernel_sparse import flashprefill


def flashprefill_block_mask(q, k, block: int, sinks_blocks: int = 1, local_blocks: int = 1,
                            threshold=None, budget=None, start: int = 0, scale=None):
    """``flashprefill.block_mask`` (torch, any device)."""
    return flashprefill.block_mask(q, k, block, sinks_blocks, local_blocks, threshold, budget, start, scale)


def block_sparse_prefill(q, k, v, mask, block: int, start: int = 0, scale=None):
    """Attention of the chunk over the kept key blocks: Triton for fp16 / bf16 CUDA tensors with
    ``block`` a power of two >= 16, the reference otherwise (fp32: the kernel's exact IEEE dots
    spill at prefill tiles). ``[s, Hq, Dv]`` in q's dtype."""
    triton_ok = q.dtype in (torch.float16, torch.bfloat16) and block >= 16 and not block & (block - 1)
    if triton_ok and sgl_kernel_sparse.use_triton(q, k, v, mask):
        from sgl_kernel_sparse.triton_flashprefill import block_sparse_attention

        return block_sparse_attention(q, k, v, mask, block, start, scale)
    return flashprefill.block_sparse_attention(q, k, v, mask, block, start, scale)


def flashprefill_attention(q, k, v, block: int, sinks_blocks: int = 1, local_blocks: int = 1,
                           threshold=None, budget=None, start: int = 0, scale=None):
    """The mask, then the attention: FlashPrefill's prefill of one chunk."""
    mask = flashprefill_block_mask(q, k, block, sinks_blocks, local_blocks, threshold, budget, start, scale)
    return block_sparse_prefill(q, k, v, mask, block, start, scale)
