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
    cells = cells.to(flat_k.device)
    return extend_over_kv(q, k_new, v_new, flat_k[cells], flat_v[cells], scale)


def extend_over_kv(q, k_new, v_new, k_prev, v_prev, scale: float) -> torch.Tensor:
    """The chunk (q ``[s, Hq, D]``, k_new / v_new ``[s, Hkv, D]``) attends the earlier rows
    ``k_prev`` / ``v_prev`` ``[P, Hkv, D]`` and itself causally. ``[s, Hq, Dv]`` in q's dtype."""
    keys = torch.cat([k_prev, k_new.to(k_prev.dtype)])
    values = torch.cat([v_prev, v_new.to(v_prev.dtype)])
    positions = k_prev.shape[0] + torch.arange(q.shape[0], device=q.device)
    probs = attention_probs(q, keys, positions, scale)  # [Hq, s, P + s]
    group = q.shape[1] // keys.shape[1]
    out = torch.einsum("hsn,nhd->shd", probs, values.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)
