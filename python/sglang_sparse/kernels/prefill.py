"""Prefill attention over rows the engine's slot table does not describe: a chunk whose earlier
rows live in per-layer cells (``LayerRowsView``: a resumed PyramidKV chain). Plain torch over
``sgl_kernel_sparse.reference.attention_probs`` (fp32 softmax), any device: the chunk attends
every earlier row plus itself causally."""

from __future__ import annotations

import torch
from sgl_kernel_sparse.reference import attention_probs


def extend_over_cells(q, k_new, v_new, flat_k, flat_v, cells, scale: float) -> torch.Tensor:
    """q ``[s, Hq, D]``, k_new / v_new ``[s, Hkv, D]`` (the chunk), ``cells`` ``[P]`` flat cells of
    the earlier rows. Returns ``[s, Hq, Dv]`` in q's dtype."""
    keys = torch.cat([flat_k[cells.to(flat_k.device)], k_new.to(flat_k.dtype)])
    values = torch.cat([flat_v[cells.to(flat_v.device)], v_new.to(flat_v.dtype)])
    positions = cells.numel() + torch.arange(q.shape[0], device=q.device)
    probs = attention_probs(q, keys, positions, scale)  # [Hq, s, P + s]
    group = q.shape[1] // keys.shape[1]
    out = torch.einsum("hsn,nhd->shd", probs, values.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)
