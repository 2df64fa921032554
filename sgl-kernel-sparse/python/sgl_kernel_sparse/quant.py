"""Quantized KV payloads, plain torch (any device): the one definition of KIVI's and FP8's
formulas. The Triton decode kernels (``triton_kivi.py``, ``triton_fp8.py``) dequantize inside
the kernel and are tested against the attention functions here. Quantization itself only runs
here (once per block of G tokens, not per decode step), so every device uses the same rounding.
Conventions of ``reference.py`` hold: positions, slots, ``req_to_token[req_row, j] -> slot``,
GQA ``h // (Hq // Hkv)``, fp32 softmax, outputs in ``q``'s dtype, zero output when nothing is
valid.

KIVI (Liu et al., 2024), b-bit asymmetric (b in {2, 4}) over a group x, all in fp32::

    mn = min(x), mx = max(x), s = (mx - mn) / (2^b - 1)
    code = clamp(floor((x - mn) / s + 0.5), 0, 2^b - 1)     (code = 0 when s == 0)
    x_hat = code * s + mn

Keys per channel over each block of G consecutive tokens (one (s, mn) per block, KV head and
channel); values per token over groups of G consecutive channels (one (s, mn) per token, KV head
and channel group; G must divide D). Default G = 32 (``KIVI_GROUP``).

Storage of one layer. A request's quantized history is a list of *blocks* of G consecutive
tokens, in token order, addressed through a block table; the most recent tokens (the
full-precision residual) stay in the ordinary token-major pool::

    block_table[req_rows[b]] = [ 7, 2, 9, ...]  (first n_blocks[b] entries valid)
                                 |
         k_codes[7] : [Hkv, G, D*b/8] uint8 ---- token t of block, channel c:
         k_scale[7], k_min[7]  : [Hkv, D]         code = byte[c // (8/b)] >> (c % (8/b))*b
         v_codes[7] : [Hkv, G, D*b/8] uint8      key   = code * k_scale[.., c] + k_min[.., c]
         v_scale[7], v_min[7]  : [Hkv, G, D/G]   value = code * v_scale[.., t, c // G] + v_min[..]

    request b, in token order:
    | block_table[r, 0] | block_table[r, 1] | ... | block n_blocks[b]-1 | residual rows       |
    |<------ G -------->|                                               |<-- res_len[b] ---->|
                                                       residual token j: k_cache[req_to_token[r, j]]
                                                       (r = req_rows[b], j in [0, res_len[b]))

Packing along the channel axis, little end first: for b = 2 byte j holds channels 4j..4j+3 in
bits (0-1, 2-3, 4-5, 6-7); for b = 4 byte j holds channel 2j (low nibble) and 2j+1 (high).
Note the residual's slot table starts at column 0: ``req_to_token[r]`` here lists only the
residual rows (the caller keeps it that way), whatever the residual tokens' positions.

FP8 (e4m3, ``torch.float8_e4m3fn``, max 448): scale = amax / 448 per tensor (``[1]``) or per KV
head (``[Hkv]``), fp32, 1.0 where amax is 0; x8 = cast(clamp(x / scale, -448, 448));
x_hat = float(x8) * scale. The pool holds ``[num_slots, Hkv, D]`` fp8 rows; request b reads
positions ``[0, seq_lens[b])`` through ``req_to_token``.
"""

from __future__ import annotations

import math

import torch

KIVI_GROUP = 32
KIVI_BITS = (2, 4)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


# ------------------------------------------------------------------ KIVI: codes and packing


def _check_bits(bits: int) -> int:
    if bits not in KIVI_BITS:
        raise ValueError(f"KIVI bits must be one of {KIVI_BITS}, got {bits}")
    return int(bits)


def kivi_quantize_groups(x, bits, dim, scale_dtype=torch.float32):
    """KIVI's b-bit asymmetric quantization of ``x`` in groups along ``dim`` (every other index
    is its own group). Returns ``(codes uint8, same shape as x; scale, mn in scale_dtype, x's
    shape without dim)``. All arithmetic in fp32; the divisions are true elementwise divisions
    (a scalar divisor may become a multiply by its reciprocal on some devices). With a
    ``scale_dtype`` narrower than fp32 (fp16: the server's store), scale and min are rounded to
    it *first* and the codes computed from the rounded values, so ``code * scale + min`` is the
    reconstruction whatever dtype holds them."""
    levels = (1 << _check_bits(bits)) - 1
    xf = x.float()
    mn = xf.amin(dim=dim, keepdim=True).to(scale_dtype).float()
    mx = xf.amax(dim=dim, keepdim=True)
    s = ((mx - mn) / torch.full_like(mx, levels)).to(scale_dtype).float()
    flat = s == 0
    code = torch.floor((xf - mn) / torch.where(flat, 1.0, s) + 0.5).clamp_(0, levels)
    code = torch.where(flat, 0.0, code).to(torch.uint8)
    return code, s.squeeze(dim).to(scale_dtype), mn.squeeze(dim).to(scale_dtype)


def pack_codes(codes, bits):
    """``codes [..., C]`` (uint8 values in ``[0, 2**bits)``, C a multiple of ``8 // bits``) ->
    ``[..., C * bits // 8]`` uint8, little end first (channel ``per*j + i`` in bits
    ``i*bits .. i*bits+bits-1`` of byte j, ``per = 8 // bits``). Out-of-range codes are a
    caller error (they would spill into the neighbouring channel's bits)."""
    per = 8 // _check_bits(bits)
    c = codes.shape[-1]
    if c % per:
        raise ValueError(f"{c} codes per row cannot be packed {per} per byte")
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    grouped = codes.to(torch.int32).reshape(*codes.shape[:-1], c // per, per)
    return (grouped << shifts).sum(dim=-1).to(torch.uint8)


def unpack_codes(packed, bits):
    """Inverse of ``pack_codes``: ``[..., P]`` uint8 -> ``[..., P * 8 // bits]`` uint8 codes."""
    per = 8 // _check_bits(bits)
    shifts = (torch.arange(per, device=packed.device, dtype=torch.int32) * bits).to(torch.uint8)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def _blocks(t, group):
    if group <= 0 or t % group:
        raise ValueError(f"{t} tokens are not a whole number of blocks of {group}")
    return t // group


def kivi_quantize_keys(k, bits, group=KIVI_GROUP, scale_dtype=torch.float32):
    """Keys ``[G*n, Hkv, D]`` -> ``(codes [n, Hkv, G, D*bits//8] uint8, scale [n, Hkv, D],
    mn [n, Hkv, D])``: per channel over each block of G consecutive tokens."""
    t, hkv, d = k.shape
    n = _blocks(t, group)
    codes, s, mn = kivi_quantize_groups(k.reshape(n, group, hkv, d), bits, dim=1, scale_dtype=scale_dtype)
    return pack_codes(codes.permute(0, 2, 1, 3), bits), s, mn  # codes [n, G, Hkv, D] -> [n, Hkv, G, D]


def kivi_quantize_values(v, bits, group=KIVI_GROUP, scale_dtype=torch.float32):
    """Values ``[G*n, Hkv, D]`` -> ``(codes [n, Hkv, G, D*bits//8] uint8, scale [n, Hkv, G, D//G],
    mn [n, Hkv, G, D//G])``: per token over groups of G consecutive channels (G divides D)."""
    t, hkv, d = v.shape
    n = _blocks(t, group)
    if d % group:
        raise ValueError(f"value group {group} does not divide head_dim {d}")
    x = v.reshape(n, group, hkv, d // group, group)  # [block, token, head, channel group, channel]
    codes, s, mn = kivi_quantize_groups(x, bits, dim=4, scale_dtype=scale_dtype)
    codes = codes.reshape(n, group, hkv, d).permute(0, 2, 1, 3)
    return (pack_codes(codes, bits), s.permute(0, 2, 1, 3).contiguous(),
            mn.permute(0, 2, 1, 3).contiguous())


def kivi_dequantize_keys(codes, scale, mn, bits):
    """``kivi_quantize_keys``'s output -> keys ``[G*n, Hkv, D]`` fp32 (``code * s + mn``)."""
    n, hkv, g, _ = codes.shape
    c = unpack_codes(codes, bits).float()  # [n, Hkv, G, D]
    x = c * scale.float().unsqueeze(2) + mn.float().unsqueeze(2)
    return x.permute(0, 2, 1, 3).reshape(n * g, hkv, c.shape[-1])


def kivi_dequantize_values(codes, scale, mn, bits):
    """``kivi_quantize_values``'s output -> values ``[G*n, Hkv, D]`` fp32 (``code * s + mn``,
    channel c of a token uses its group ``c // (D // scale.shape[-1])``)."""
    n, hkv, g, _ = codes.shape
    c = unpack_codes(codes, bits).float()  # [n, Hkv, G, D]
    d = c.shape[-1]
    n_grp = scale.shape[-1]
    c = c.view(n, hkv, g, n_grp, d // n_grp)
    x = c * scale.float().unsqueeze(-1) + mn.float().unsqueeze(-1)
    return x.view(n, hkv, g, d).permute(0, 2, 1, 3).reshape(n * g, hkv, d)


def check_kivi_layout(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_cache, v_cache,
                      bits, group):
    """Shape checks shared by the reference and the Triton wrapper; returns ``(Hkv, D)``."""
    _check_bits(bits)
    b, hq, d = q.shape
    nblk, hkv, g, p = k_codes.shape
    if g != group:
        raise ValueError(f"k_codes hold blocks of {g} tokens, group={group}")
    if d % group:
        raise ValueError(f"value group {group} does not divide head_dim {d}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    want = {
        "k_codes": (k_codes, (nblk, hkv, group, d * bits // 8)),
        "v_codes": (v_codes, (nblk, hkv, group, d * bits // 8)),
        "k_scale": (k_scale, (nblk, hkv, d)),
        "k_min": (k_min, (nblk, hkv, d)),
        "v_scale": (v_scale, (nblk, hkv, group, d // group)),
        "v_min": (v_min, (nblk, hkv, group, d // group)),
    }
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
    for name, t in (("k_codes", k_codes), ("v_codes", v_codes)):
        if t.dtype != torch.uint8:
            raise ValueError(f"{name} must be uint8, got {t.dtype}")
    if k_cache.shape[1:] != (hkv, d) or v_cache.shape[1:] != (hkv, d):
        raise ValueError(f"residual pools {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         f"vs [slots, {hkv}, {d}]")
    return hkv, d


# ------------------------------------------------------------------ attention references


def _scale(scale, d):
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _attend(q, k, v, scale):
    """One decode query per head ``q [Hq, D]`` over ``k, v [N, Hkv, D]`` (fp32), GQA."""
    group = q.shape[0] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), k) * scale, dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v)


def kivi_decode_attention(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, block_table,
                          req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len, bits,
                          group=KIVI_GROUP, scale=None):
    """Decode attention over KIVI-quantized history plus a full-precision residual.

    q ``[B, Hq, D]``; the quantized blocks and their tables as in the module docstring
    (``block_table [R, max_blocks]``, ``n_blocks [B]``); residual pools ``k_cache/v_cache
    [num_slots, Hkv, D]`` read at ``req_to_token[req_rows[b], :res_len[b]]``. Each query head
    attends (fp32 softmax, default scale ``1/sqrt(D)``) over its request's ``n_blocks[b]*G``
    dequantized tokens followed by its ``res_len[b]`` residual rows. ``[B, Hq, D]`` in q's dtype;
    zeros for a request with nothing."""
    check_kivi_layout(q, k_codes, k_scale, k_min, v_codes, v_scale, v_min, k_cache, v_cache,
                      bits, group)
    b_, hq, d = q.shape
    sc = _scale(scale, d)
    out = torch.zeros(b_, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        row = int(req_rows[b])
        blocks = block_table[row, : int(n_blocks[b])].long()
        slots = req_to_token[row, : int(res_len[b])].long()
        k = torch.cat([kivi_dequantize_keys(k_codes[blocks], k_scale[blocks], k_min[blocks], bits),
                       k_cache[slots].float()])
        v = torch.cat([kivi_dequantize_values(v_codes[blocks], v_scale[blocks], v_min[blocks], bits),
                       v_cache[slots].float()])
        if k.shape[0]:
            out[b] = _attend(q[b], k, v, sc)
    return out.to(q.dtype)


# ------------------------------------------------------------------ FP8 (e4m3)


def _per_head(scale, x):
    """Scale ``[1]`` or ``[Hkv]`` broadcast over ``x [..., Hkv, D]``."""
    scale = scale.float().reshape(-1)
    if scale.numel() not in (1, x.shape[-2]):
        raise ValueError(f"fp8 scale has {scale.numel()} entries; expected 1 or Hkv={x.shape[-2]}")
    return scale.view(-1, 1)


def fp8_scales(x, per_head=True):
    """``x [T, Hkv, D]`` -> fp32 scale ``amax / 448``: ``[Hkv]`` per KV head, else ``[1]``;
    1.0 where the amax is 0 (an all-zero head)."""
    a = x.float().abs()
    if a.numel() == 0:
        amax = torch.zeros(x.shape[1] if per_head else 1, device=x.device)
    else:
        amax = a.amax(dim=(0, 2)) if per_head else a.amax().reshape(1)
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), 1.0)


def fp8_quantize(x, scale):
    """``x [..., Hkv, D]`` -> float8_e4m3fn ``cast(clamp(x / scale, -448, 448))``."""
    y = x.float() / _per_head(scale, x)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_dequantize(x8, scale):
    """float8 ``[..., Hkv, D]`` -> fp32 ``float(x8) * scale``."""
    return x8.float() * _per_head(scale, x8)


def fp8_decode_attention(q, k8, v8, k_scale, v_scale, req_to_token, req_rows, seq_lens,
                         scale=None):
    """Dense decode attention over an fp8 token-major pool ``k8/v8 [num_slots, Hkv, D]``
    (``float8_e4m3fn``) with scales ``[Hkv]`` or ``[1]``: request b's query heads attend over
    positions ``[0, seq_lens[b])``, slots ``req_to_token[req_rows[b], pos]``. ``[B, Hq, D]``
    in q's dtype, zeros for an empty request."""
    b_, hq, d = q.shape
    if hq % k8.shape[1]:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={k8.shape[1]}")
    sc = _scale(scale, d)
    out = torch.zeros(b_, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        slots = req_to_token[int(req_rows[b]), : int(seq_lens[b])].long()
        if slots.numel():
            out[b] = _attend(q[b], fp8_dequantize(k8[slots], k_scale),
                             fp8_dequantize(v8[slots], v_scale), sc)
    return out.to(q.dtype)
