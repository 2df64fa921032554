"""Palu (Chang et al., 2024): low-rank latent K/V, plain torch (any device): the one definition of
its formulas here (the store, the server's decode and the tests use these).

A layer's key and value projections are factored per *group* of g KV heads (``sglang_sparse.core.
lowrank``): ``W_g^T ~= A_g B_g``, ``A_g [hidden, r]``, ``B_g [r, g*d]``. A token's latent is
``h = x A`` (r numbers per group, for K and for V); attention uses the reconstruction::

    k = RoPE_pos(h_k B_k + b_k)        v = h_v B_v + b_v        (per group, heads in group order)

Latent layout (one group ``[n_groups]`` axis; heads ``[gi*g, (gi+1)*g)`` belong to group gi)::

    h      [..., n_groups, r]
    B      [n_groups, r, g*d]           pinv(B) [n_groups, g*d, r]
    bias   [H*d] or None

RoPE: ``cos_sin [max_pos, rotary_dim]`` = cos of the ``rotary_dim/2`` frequencies then their sin
(the model's own table); neox style rotates the halves ``(x1, x2) = (x[:rd/2], x[rd/2:rd])``,
GPT-J style the pairs ``(x[0::2], x[1::2])`` of the first ``rotary_dim`` channels; the channels past
``rotary_dim`` pass through. ``rope_invert`` is the rotation by ``-theta`` (sin negated): the
exact inverse, so a pool row ``RoPE(h B + b)`` gives back ``h = (RoPE^-1(row) - b) pinv(B)``
(``recover_latents``).

Blocks: a request's stored history is a list of blocks of G consecutive tokens; per layer
``lat_k / lat_v [num_blocks, n_groups, G, r]``; block j of a request holds logical positions
``[jG, (j+1)G)`` (the order of its block table), so RoPE positions come with the table.
"""

from __future__ import annotations

import math

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x [n, H, d]`` (fp32) by the angles of
    ``cos / sin [n, rd/2]``; the other channels pass through."""
    rd = 2 * cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if neox:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    else:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    return torch.cat([out, xp], dim=-1)


def _cos_sin(cos_sin: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cs = cos_sin.index_select(0, pos.long().to(cos_sin.device)).float()
    half = cs.shape[-1] // 2
    return cs[..., :half], cs[..., half:]


def rope_apply(x: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, neox: bool) -> torch.Tensor:
    """``x [n, H, d]`` rotated at positions ``pos [n]`` (fp32)."""
    cos, sin = _cos_sin(cos_sin, pos)
    return _rotate(x.float(), cos, sin, neox)


def rope_invert(x: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, neox: bool) -> torch.Tensor:
    """The inverse of ``rope_apply`` at the same positions (rotation by minus the angle), fp32."""
    cos, sin = _cos_sin(cos_sin, pos)
    return _rotate(x.float(), cos, -sin, neox)


def palu_reconstruct(h: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``h [n, n_groups, r]`` -> ``[n, H*d]`` fp32: each group's ``h_g B_g`` (+ bias), heads in
    group order."""
    n, ng, _ = h.shape
    out = torch.einsum("ngr,grc->ngc", h.float(), b.float()).reshape(n, ng * b.shape[-1])
    if bias is not None:
        out = out + bias.float()
    return out


def recover_latents(rows: torch.Tensor, pinv: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Latents of full-precision rows already un-rotated: ``rows [n, H, d]`` -> ``[n, n_groups, r]``
    fp32, ``(rows - bias) pinv(B)`` per group (exact when the rows lie in the span of B)."""
    n = rows.shape[0]
    flat = rows.float().reshape(n, -1)
    if bias is not None:
        flat = flat - bias.float()
    ng = pinv.shape[0]
    return torch.einsum("ngc,gcr->ngr", flat.reshape(n, ng, -1), pinv.float())


def latent_blocks(h: torch.Tensor, group: int) -> torch.Tensor:
    """``h [n*G, n_groups, r]`` (tokens in order) -> the block layout ``[n, n_groups, G, r]``."""
    t, ng, r = h.shape
    if group <= 0 or t % group:
        raise ValueError(f"{t} tokens are not a whole number of blocks of {group}")
    return h.reshape(t // group, group, ng, r).transpose(1, 2).contiguous()


def blocks_to_tokens(lat: torch.Tensor) -> torch.Tensor:
    """Inverse of ``latent_blocks``: ``[n, n_groups, G, r]`` -> ``[n*G, n_groups, r]``."""
    n, ng, g, r = lat.shape
    return lat.transpose(1, 2).reshape(n * g, ng, r)


def reconstruct_blocks(lat_k, lat_v, bk, bv, bias_k, bias_v, cos_sin, neox, head_dim, start: int = 0):
    """K (rotated at positions ``start + [0, n*G)``) and V ``[n*G, H, d]`` fp32 of the blocks
    ``lat_k / lat_v [n, n_groups, G, r]``, in the order given."""
    hk, hv = blocks_to_tokens(lat_k), blocks_to_tokens(lat_v)
    t, heads = hk.shape[0], bk.shape[0] * bk.shape[-1] // head_dim
    k = palu_reconstruct(hk, bk, bias_k).reshape(t, heads, head_dim)
    v = palu_reconstruct(hv, bv, bias_v).reshape(t, heads, head_dim)
    pos = torch.arange(start, start + t, device=k.device)
    return rope_apply(k, cos_sin, pos, neox), v


def _attend(q, k, v, scale):
    """One decode query per head ``q [Hq, d]`` over ``k / v [n, Hkv, d]`` (GQA), fp32 softmax."""
    hq, d = q.shape
    hkv = k.shape[1]
    qg = q.float().view(hkv, hq // hkv, d)
    logits = torch.einsum("hgd,nhd->hgn", qg, k.float()) * scale
    p = torch.softmax(logits, dim=-1)
    return torch.einsum("hgn,nhd->hgd", p, v.float()).reshape(hq, -1)


def palu_decode_attention(q, lat_k, lat_v, bk, bv, bias_k, bias_v, cos_sin, neox, block_table, req_rows, n_blocks,
                          k_cache, v_cache, req_to_token, res_len, scale=None):
    """Decode attention over Palu latent blocks + a full-precision residual (the reference: each
    request's blocks are reconstructed to K/V, K rotated at ``jG + o``, then plain attention).

    q ``[B, Hq, d]``; latents ``[num_blocks, n_groups, G, r]`` of one layer; ``block_table [R,
    max_blocks]``, ``n_blocks [B]``; the residual rows of ``k_cache / v_cache [slots, Hkv, d]`` at
    ``req_to_token[req_rows[b], :res_len[b]]`` follow the blocks. fp32 softmax (default scale
    ``1/sqrt(d)``); ``[B, Hq, d]`` in q's dtype; zeros for a request with nothing."""
    b_, hq, d = q.shape
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, hq, v_cache.shape[-1], dtype=torch.float32, device=q.device)
    for b in range(b_):
        row = int(req_rows[b])
        blocks = block_table[row, : int(n_blocks[b])].long()
        slots = req_to_token[row, : int(res_len[b])].long()
        kh, vh = reconstruct_blocks(lat_k[blocks], lat_v[blocks], bk, bv, bias_k, bias_v, cos_sin, neox, d)
        k = torch.cat([kh, k_cache[slots].float()])
        v = torch.cat([vh, v_cache[slots].float()])
        if k.shape[0]:
            out[b] = _attend(q[b], k, v, sc)
    return out.to(q.dtype)
