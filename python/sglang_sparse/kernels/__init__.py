"""Kernels of the sparse hot paths, as the methods and the adapter call them.

The formulas and their Triton kernels live in the kernel package ``sgl_kernel_sparse``
(``sgl-kernel-sparse/``): each public function there runs Triton on CUDA tensors and its
plain-torch reference (``sgl_kernel_sparse.reference``, the one definition of each formula)
elsewhere. Here: decode attention over a batch's views (``decode``) and Quest's per-physical-page
summaries (``quest_pages``), plus the kernel package's functions the methods use.
"""

from sgl_kernel_sparse import compact_kv, snapkv_keep_indices, stable_topk, token_logits  # noqa: F401
