"""FlashPrefill (block-sparse prefill attention), plain torch on any device: the definitions that
``triton_flashprefill`` is tested against.

Index conventions (one request, one layer):

- A prefill *chunk* holds the queries of absolute positions ``[start, start + s)``: chunk row
  ``i`` is position ``start + i``. Its keys / values are positions ``[0, start + s)`` (the
  earlier context plus the chunk itself), so ``k.shape[0] == start + s``. A whole prompt is
  ``start = 0``.
- Blocks are aligned to *absolute* positions: block ``j`` covers positions
  ``[j * block, (j + 1) * block)``. There are ``n_kb = ceil((start + s) / block)`` key blocks
  (the last one may be partial). The chunk's query blocks are the absolute blocks
  ``qb0 .. qb0 + n_qb - 1`` with ``qb0 = start // block`` (its first query block may be partial
  when ``start`` is not a multiple of ``block``, its last one when ``start + s`` is not).
- A block mask is bool ``[Hq, n_qb, n_kb]``: ``mask[h, r, j]`` says whether query head ``h``'s
  queries of absolute block ``qb0 + r`` read key block ``j``. Causality inside a kept block is
  by position: query at position ``p`` reads key ``n`` iff its block is kept and ``n <= p``.
- GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. The mask is per *query* head: each
  query head pools its own queries and scores them against its KV head's pooled keys.
- Scores, softmax and accumulation in fp32; attention output in ``q``'s dtype; a query that
  reads no key (only possible with a hand-made mask that drops its diagonal block) outputs zeros.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _scale(scale, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def block_layout(s: int, start: int, block: int) -> tuple[int, int, int]:
    """``(qb0, n_qb, n_kb)`` of a chunk of ``s`` queries at absolute positions
    ``[start, start + s)`` attending keys ``[0, start + s)``; see the module docstring."""
    if block < 1 or start < 0 or s < 0:
        raise ValueError(f"need block >= 1, start >= 0, s >= 0; got {block}, {start}, {s}")
    qb0 = start // block
    n_qb = (start + s - 1) // block - qb0 + 1 if s else 0
    return qb0, n_qb, -(-(start + s) // block)


def _pool_rows(x, first: int, block: int, n_blocks: int):
    """Mean over each block of rows. ``x [m, H, D]`` holds absolute positions
    ``[first, first + m)``; block ``b`` (of ``n_blocks``, the first one absolute block
    ``first // block``) averages the positions of ``[first, first + m)`` it covers. fp32."""
    m = x.shape[0]
    front = first - (first // block) * block  # rows of the first block before `first`
    back = n_blocks * block - front - m
    padded = F.pad(x.float(), (0, 0, 0, 0, front, back))  # zero rows add nothing to a sum
    sums = padded.view(n_blocks, block, *x.shape[1:]).sum(dim=1)
    lo = (first // block + torch.arange(n_blocks, device=x.device)) * block  # absolute block starts
    count = (lo + block).clamp(max=first + m) - lo.clamp(min=first)
    return sums / count.view(-1, 1, 1).float()


def block_scores(q, k, block: int, start: int = 0, scale=None):
    """fp32 ``[Hq, n_qb, n_kb]``: ``scale * mean(q of query block) . mean(k of key block)`` with
    the means over the positions present (a partial first / last block averages what it has), the
    key means per KV head and query head ``h`` reading KV head ``h // (Hq // Hkv)``. Not masked."""
    s, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    if n != start + s:
        raise ValueError(f"k holds positions [0, start + s): need {start + s} rows, got {n}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    qb0, n_qb, n_kb = block_layout(s, start, block)
    q_pool = _pool_rows(q, start, block, n_qb)  # [n_qb, Hq, D], chunk rows = positions start..
    k_pool = _pool_rows(k, 0, block, n_kb).repeat_interleave(hq // hkv, dim=1)  # [n_kb, Hq, D]
    return torch.einsum("ahd,jhd->haj", q_pool, k_pool) * _scale(scale, d)


def block_mask(q, k, block: int, sinks_blocks: int = 1, local_blocks: int = 1, threshold=None,
               budget=None, start: int = 0, scale=None):
    """FlashPrefill's keep mask, bool ``[Hq, n_qb, n_kb]`` (see the module docstring for shapes).

    For query head ``h`` and absolute query block ``a = qb0 + r`` the candidates are the causal
    key blocks ``j <= a``; ``p_j`` = softmax over them of ``block_scores``. Kept:

    1. *forced*: sinks ``j < sinks_blocks`` and local blocks ``a - local_blocks < j <= a`` (the
       diagonal and the ``local_blocks - 1`` before it; ``local_blocks >= 1``, so every query
       reads at least its own block);
    2. then the other candidates in descending ``p_j`` (ties: the lower ``j`` first), one at a
       time while the kept mass ``sum p`` (forced blocks included) is below ``threshold``
       (a top-p rule) and fewer than ``budget`` blocks (forced blocks included) are kept.

    ``threshold`` None: no mass rule; ``budget`` None: no count rule; both None, or
    ``threshold >= 1``: every causal block (dense). Forced blocks are kept even past ``budget``.
    The kept mass is summed in float64 from the fp32 probabilities.
    """
    if local_blocks < 1:
        raise ValueError("local_blocks must be >= 1 (the diagonal block is always kept)")
    if budget is not None and budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    s, hq = q.shape[0], q.shape[1]
    if k.shape[0] != start + s:
        raise ValueError(f"k holds positions [0, start + s): need {start + s} rows, got {k.shape[0]}")
    qb0, n_qb, n_kb = block_layout(s, start, block)
    a = (qb0 + torch.arange(n_qb, device=q.device)).view(-1, 1)  # absolute query block
    j = torch.arange(n_kb, device=q.device).view(1, -1)  # key block
    causal = (j <= a).expand(hq, n_qb, n_kb)
    if n_qb == 0 or (threshold is None and budget is None) or (threshold is not None and threshold >= 1):
        return causal.clone()
    forced = causal & ((j < sinks_blocks) | (j > a - local_blocks))
    probs = torch.softmax(block_scores(q, k, block, start, scale).masked_fill(~causal, float("-inf")), -1)
    rest = torch.where(causal & ~forced, probs, -1.0)  # non-candidates sort after every candidate
    ranked, order = torch.sort(rest, dim=-1, descending=True, stable=True)  # ties: lower j first
    candidate = ranked >= 0
    ranked_mass = torch.cumsum(ranked.clamp(min=0).double(), -1)  # mass of the first t+1 ranked
    ranked_before = F.pad(ranked_mass[..., :-1], (1, 0))  # ... of the first t (exclusive)
    mass_before = torch.where(forced, probs, 0.0).double().sum(-1, keepdim=True) + ranked_before
    take = candidate
    if threshold is not None:
        take = take & (mass_before < threshold)
    if budget is not None:
        count_before = forced.sum(-1, keepdim=True) + torch.arange(n_kb, device=q.device)
        take = take & (count_before < budget)
    return forced | torch.zeros_like(forced).scatter(-1, order, take)


def keep_all_mask(q_len: int, hq: int, block: int, start: int = 0, device=None):
    """Every causal block: the mask with which block-sparse attention is dense causal attention."""
    qb0, n_qb, n_kb = block_layout(q_len, start, block)
    a = (qb0 + torch.arange(n_qb, device=device)).view(-1, 1)
    return (torch.arange(n_kb, device=device).view(1, -1) <= a).expand(hq, n_qb, n_kb).clone()


def token_visibility(mask, s: int, n: int, block: int, start: int = 0):
    """bool ``[Hq, s, n]``: chunk row ``i`` (position ``start + i``) reads key ``n'`` iff the
    block mask keeps ``(row block, n' // block)`` and ``n' <= start + i``."""
    pos = start + torch.arange(s, device=mask.device)  # absolute query positions
    rows = pos // block - start // block  # mask row of each query
    kpos = torch.arange(n, device=mask.device)
    kept = mask[:, rows][:, :, kpos // block]
    return kept & (kpos.view(1, -1) <= pos.view(-1, 1))


def block_sparse_attention(q, k, v, mask, block: int, start: int = 0, scale=None):
    """Causal attention of the chunk ``q [s, Hq, D]`` (positions ``[start, start + s)``) over
    ``k [start + s, Hkv, D]``, ``v [start + s, Hkv, Dv]``, reading only the key blocks ``mask``
    keeps (``[Hq, n_qb, n_kb]``). Logits of unread keys are ``-inf``, so they weigh exactly 0;
    with ``keep_all_mask`` this is ``reference.attention_probs`` dense attention, bit for bit.
    Returns ``[s, Hq, Dv]`` in q's dtype."""
    s, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    qb0, n_qb, n_kb = block_layout(s, start, block)
    if n != start + s or mask.shape != (hq, n_qb, n_kb):
        raise ValueError(f"need k rows {start + s} and mask {(hq, n_qb, n_kb)}, "
                         f"got {n} and {tuple(mask.shape)}")
    group = hq // hkv
    logits = torch.einsum("shd,nhd->hsn", q.float(), k.float().repeat_interleave(group, dim=1)) * _scale(scale, d)
    visible = token_visibility(mask.to(q.device), s, n, block, start)
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    probs = torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # a row reading nothing -> 0
    out = torch.einsum("hsn,nhd->shd", probs, v.float().repeat_interleave(group, dim=1))
    return out.to(q.dtype)
