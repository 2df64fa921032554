"""DeltaKV (arXiv 2602.08005): residual coding of KV against similar earlier tokens, plain torch
(any device): the one definition of its formulas here (the store, the server's decode, the fit
and the tests use these).

A token's *vector* is its pre-RoPE K and V, every KV head, concatenated: ``kv = [K_0..K_{H-1} |
V_0..V_{H-1}]``, width ``W = 2 H d`` (K channels ``[0, H d)``, V channels ``[H d, W)``).

References: within a request's stored history (blocks of G tokens, block j holding logical
positions ``[jG, (j+1)G)``), the tokens at offsets ``o % stride == 0`` of every block are
*references*, stored exact. They are numbered in order over the request (*reference ordinals*:
ordinal q lives in block ``q // (G/stride)``, slot ``q % (G/stride)``, logical position
``q * stride``), so a block only ever points into itself or earlier blocks (prefix-closed: valid
for any request sharing the prefix of blocks).

Fathers of a token at position t: the ``neighbors`` references at positions <= t with the highest
similarity of K (the K channels of the vector):

    l2:      2 a.b - |b|^2   (= |a|^2 - |a - b|^2: the l2-nearest first)
    dot:     a.b
    cosine:  a.b / (|a| |b|)

ties go to the lower ordinal; fewer than ``neighbors`` references: the rest is -1. Position 0
is a reference, so every token has at least one father. ``base = mean of the fathers' vectors``.

Compressor (per layer; the paper's parametrisation: ``down`` linear without bias, ``up`` linear
with bias)::

    down [m, W]     up [W, m]     b_up [W]
    encode:  c  = down(kv) - down(base)          = (kv - base) down^T      (m numbers)
    decode:  kv^ = up(c) + base                  = c up^T + b_up + base

A reference's vector is stored exact and read as is (its own code and fathers are stored by the
fixed block layout and never read). K of the decoded vector is rotated with the model's RoPE at
the token's logical position before attention (``sgl_kernel_sparse.palu.rope_apply``).

Per layer, per block: ``codes [G, m]``, ``fathers [G, neighbors]`` int32 (ordinals), ``refs
[G/stride, W]``.
"""

from __future__ import annotations

import math

import torch

from sgl_kernel_sparse.palu import rope_apply

METRICS = ("l2", "dot", "cosine")


def similarity(a: torch.Tensor, b: torch.Tensor, metric: str) -> torch.Tensor:
    """``a [n, c]``, ``b [r, c]`` -> ``[n, r]`` fp32, larger = more similar (module docstring)."""
    a, b = a.float(), b.float()
    dot = a @ b.t()
    if metric == "l2":
        return 2 * dot - (b * b).sum(-1)[None]
    if metric == "dot":
        return dot
    if metric == "cosine":
        return dot / (a.norm(dim=-1)[:, None] * b.norm(dim=-1)[None]).clamp_min(1e-30)
    raise ValueError(f"metric={metric!r} is not one of {', '.join(METRICS)}")


def assign_fathers(k_tok: torch.Tensor, k_refs: torch.Tensor, allowed: torch.Tensor, neighbors: int,
                   metric: str = "l2") -> torch.Tensor:
    """Top-``neighbors`` references of each token: ``k_tok [n, c]`` (K channels), ``k_refs [r, c]``,
    ``allowed [n, r]`` bool (the causal mask: reference position <= token position) -> ordinals
    ``[n, neighbors]`` int64, most similar first, ties to the lower ordinal, -1 padding."""
    n, r = allowed.shape
    out = torch.full((n, neighbors), -1, dtype=torch.int64, device=k_tok.device)
    if r == 0 or n == 0:
        return out
    score = similarity(k_tok, k_refs, metric).masked_fill(~allowed, float("-inf"))
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :neighbors]  # stable: lower first
    take = order.shape[1]
    valid = allowed.gather(1, order)
    out[:, :take] = torch.where(valid, order, torch.full_like(order, -1))
    return out


def causal_mask(start: int, count: int, n_refs: int, stride: int, device=None) -> torch.Tensor:
    """``[count, n_refs]`` bool: reference ordinal q (position ``q * stride``) is allowed for the
    token at position ``start + i`` when ``q * stride <= start + i``."""
    pos = torch.arange(start, start + count, device=device)
    ref_pos = torch.arange(n_refs, device=device) * stride
    return ref_pos[None] <= pos[:, None]


def ref_offsets(group: int, stride: int, device=None) -> torch.Tensor:
    """Offsets of a block's references: ``0, stride, 2 stride, ...`` (``group / stride`` of them)."""
    return torch.arange(0, group, stride, device=device)


def base_of(fathers: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """``fathers [n, k]`` (ordinals, -1 = none) into ``refs [r, W]`` -> the mean of the valid
    fathers' vectors ``[n, W]`` fp32 (a row without any valid father gets zeros)."""
    valid = fathers >= 0
    got = refs.float()[fathers.clamp_min(0)] * valid[..., None]
    return got.sum(1) / valid.sum(1, keepdim=True).clamp_min(1)


def encode(kv: torch.Tensor, base: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """``c = down(kv) - down(base)`` (``down`` linear without bias): ``[n, W] -> [n, m]`` fp32."""
    return (kv.float() - base.float()) @ down.float().t()


def decode(code: torch.Tensor, base: torch.Tensor, up: torch.Tensor, b_up: torch.Tensor) -> torch.Tensor:
    """``kv^ = up(c) + base = c up^T + b_up + base``: ``[n, m] -> [n, W]`` fp32."""
    return code.float() @ up.float().t() + b_up.float() + base.float()


def kv_vectors(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Pre-RoPE ``k / v [n, H, d]`` -> vectors ``[n, 2 H d]`` fp32 (K heads, then V heads)."""
    n = k.shape[0]
    return torch.cat([k.float().reshape(n, -1), v.float().reshape(n, -1)], dim=1)


def reconstruct(codes, fathers, refs, up, b_up, group: int) -> torch.Tensor:
    """The vectors ``[n*G, W]`` fp32 of a request's first n blocks, given in order from its block
    0: ``codes [n, G, m]``, ``fathers [n, G, k]`` (ordinals into these blocks' references),
    ``refs [n, G/stride, W]``. Logical ``[0, n*G)``."""
    n, g, _ = codes.shape
    per = refs.shape[1]
    stride = group // per
    all_refs = refs.reshape(n * per, refs.shape[-1])  # ordinal order: block, then slot
    kv = decode(codes.reshape(n * g, codes.shape[-1]), base_of(fathers.reshape(n * g, fathers.shape[-1]).long(),
                                                              all_refs), up, b_up)
    at = (torch.arange(n, device=kv.device)[:, None] * g + ref_offsets(g, stride, kv.device)[None]).reshape(-1)
    kv[at] = all_refs.float()  # references: exact
    return kv


def split_rotate(kv: torch.Tensor, heads: int, head_dim: int, cos_sin, neox: bool, start: int = 0):
    """Vectors ``[n, W]`` -> K rotated at positions ``start + [0, n)`` and V, ``[n, H, d]`` fp32."""
    n, hd = kv.shape[0], heads * head_dim
    k = kv[:, :hd].reshape(n, heads, head_dim)
    v = kv[:, hd:].reshape(n, heads, head_dim)
    return rope_apply(k, cos_sin, torch.arange(start, start + n, device=kv.device), neox), v


def reconstruct_blocks(codes, fathers, refs, up, b_up, cos_sin, neox, heads: int, head_dim: int):
    """K (rotated at logical ``[0, n*G)``) and V ``[n*G, H, d]`` fp32 of a request's first n blocks."""
    kv = reconstruct(codes, fathers, refs, up, b_up, codes.shape[1])
    return split_rotate(kv, heads, head_dim, cos_sin, neox)


def _attend(q, k, v, scale):
    """One decode query per head ``q [Hq, d]`` over ``k / v [n, Hkv, d]`` (GQA), fp32 softmax."""
    hq, d = q.shape
    hkv = k.shape[1]
    logits = torch.einsum("hgd,nhd->hgn", q.float().view(hkv, hq // hkv, d), k.float()) * scale
    return torch.einsum("hgn,nhd->hgd", torch.softmax(logits, dim=-1), v.float()).reshape(hq, -1)


def deltakv_decode_attention(q, codes, fathers, refs, up, b_up, cos_sin, neox, block_table, req_rows, n_blocks,
                             k_cache, v_cache, req_to_token, res_len, scale=None):
    """Decode attention over DeltaKV blocks + a full-precision residual (the reference: each
    request's blocks reconstructed, K rotated at ``jG + o``, then plain attention).

    q ``[B, Hq, d]``; ``codes [num_blocks, G, m]``, ``fathers [num_blocks, G, k]``, ``refs
    [num_blocks, G/stride, W]`` of one layer; ``up [W, m]``, ``b_up [W]``; ``block_table [R,
    max_blocks]``, ``n_blocks [B]``; the residual rows of ``k_cache / v_cache [slots, Hkv, d]`` at
    ``req_to_token[req_rows[b], :res_len[b]]`` follow the blocks (logical ``n_blocks * G`` on).
    fp32 softmax (default scale ``1/sqrt(d)``); ``[B, Hq, d]`` in q's dtype; zeros for a request
    with nothing."""
    b_, hq, d = q.shape
    heads = k_cache.shape[1]
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, hq, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(b_):
        row = int(req_rows[b])
        blocks = block_table[row, : int(n_blocks[b])].long()
        slots = req_to_token[row, : int(res_len[b])].long()
        kh, vh = reconstruct_blocks(codes[blocks], fathers[blocks], refs[blocks], up, b_up, cos_sin, neox, heads, d)
        k = torch.cat([kh, k_cache[slots].float()])
        v = torch.cat([vh, v_cache[slots].float()])
        if k.shape[0]:
            out[b] = _attend(q[b], k, v, sc)
    return out.to(q.dtype)
