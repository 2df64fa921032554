"""TurboQuant (Zandieh et al., ICLR 2026), the MSE quantizer, plain torch (any device): the one
definition of its formulas here.

A vector x in R^D (one token's key or value for one KV head) is stored as its L2 norm and the
b-bit codes of its direction after a random rotation::

    y = (x / |x|) @ R^T                  R: [D, D] random orthogonal, seeded (``rotation``)
    code_c = argmin_i |y_c - centroid_i|  per coordinate c, b bits (``codebook``)
    x_hat = |x| * (centroid[code] @ R)

After the rotation every coordinate of a unit vector follows the same density (that of one
coordinate of a uniform point on the unit sphere, ``coordinate_density``, close to N(0, 1/D)),
whatever x was, so one scalar codebook serves every coordinate: the Lloyd-Max quantizer of that
density (``codebook``: the b-bit centroids that minimise the expected squared error, computed
here by Lloyd's iterations on a fine grid, in float64). The expected squared error of a unit
vector is then ``D * E[(y_c - Q(y_c))^2]`` (``expected_mse``): about 0.36, 0.117, 0.035, 0.0095
at b = 1, 2, 3, 4 (the paper's D_mse).

Choices the paper leaves to the implementation (documented for the method that serves it):

- the rotation is a Haar-random orthogonal matrix, the Q of the QR decomposition of a seeded
  Gaussian matrix with the signs of R's diagonal folded in (``rotation``), fp32;
- the norm is stored in ``norm_dtype`` (fp16 in the server's store); the codes are chosen for
  the direction, so the norm's rounding scales x_hat without changing its codes;
- a zero vector has norm 0 and codes of the zero direction (x_hat = 0 exactly);
- codes are packed little end first into a bit stream along the channel axis (``pack_bits``):
  channel c's code occupies bits ``c*b .. c*b+b-1`` of the row (bit j of a row lives in byte
  j // 8, bit j % 8), so b = 3 packs 8 channels into 3 bytes; ``D * b`` must be a multiple of 8.

Attention over quantized keys needs no dequantized key: q . x_hat = |x| * ((q @ R^T) . centroid
[code]), so the query is rotated once per head (``rotate``) and the values are summed in the
rotated space and rotated back once (``turboquant_attention``).
"""

from __future__ import annotations

import functools
import math

import torch

TURBOQUANT_BITS = (1, 2, 3, 4)
GRID = 1 << 17  # points of the fine grid the codebook is computed on
LLOYD_ITERS = 300


def _check_bits(bits: int) -> int:
    if bits not in TURBOQUANT_BITS:
        raise ValueError(f"TurboQuant bits must be one of {TURBOQUANT_BITS}, got {bits}")
    return int(bits)


def coordinate_density(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Density of one coordinate of a uniform point on the unit sphere of R^dim, on [-1, 1]:
    ``Gamma(dim/2) / (sqrt(pi) Gamma((dim-1)/2)) * (1 - x^2)^((dim-3)/2)`` (float64)."""
    if dim < 2:
        raise ValueError(f"dim must be at least 2, got {dim}")
    log_c = math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2)
    inside = (1 - x.double() ** 2).clamp_min(0)
    return torch.exp(log_c + (dim - 3) / 2 * torch.log(inside.clamp_min(1e-300))) * (inside > 0)


@functools.lru_cache(maxsize=None)
def _codebook(bits: int, dim: int) -> tuple[tuple[float, ...], float]:
    """(centroids ascending, expected squared error per coordinate) of the Lloyd-Max quantizer of
    ``coordinate_density(dim)``, by Lloyd's iterations on a grid of ``GRID`` cells over the
    range that holds all but ~1e-12 of the mass (midpoint rule)."""
    levels = 1 << _check_bits(bits)
    reach = min(1.0, 12.0 / math.sqrt(dim))  # > 12 standard deviations (std ~ 1/sqrt(dim))
    edges = torch.linspace(-reach, reach, GRID + 1, dtype=torch.float64)
    x = (edges[1:] + edges[:-1]) / 2
    w = coordinate_density(x, dim) * (edges[1] - edges[0])
    w = w / w.sum()
    cdf = torch.cumsum(w, 0)
    # start at the quantiles of the cell centres (symmetric, distinct)
    c = x[torch.searchsorted(cdf, (torch.arange(levels, dtype=torch.float64) + 0.5) / levels).clamp(max=GRID - 1)]
    for _ in range(LLOYD_ITERS):
        cell = torch.bucketize(x, (c[1:] + c[:-1]) / 2)  # nearest centroid of each grid point
        mass = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w)
        moment = torch.zeros(levels, dtype=torch.float64).index_add_(0, cell, w * x)
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), c)
        if torch.allclose(new, c, rtol=0, atol=1e-12):
            c = new
            break
        c = new
    c = (c - c.flip(0)) / 2  # exact symmetry about 0 (the density is even)
    cell = torch.bucketize(x, (c[1:] + c[:-1]) / 2)
    mse = float((w * (x - c[cell]) ** 2).sum())
    return tuple(float(v) for v in c), mse


def codebook(bits: int, dim: int, device=None) -> torch.Tensor:
    """The b-bit centroids ``[2**bits]`` (fp32, ascending, symmetric about 0) for vectors of
    dimension ``dim`` (see the module docstring)."""
    return torch.tensor(_codebook(bits, dim)[0], dtype=torch.float32, device=device)


def expected_mse(bits: int, dim: int) -> float:
    """Expected ``|y - Q(y)|^2`` of a rotated unit vector: ``dim`` x the per-coordinate error."""
    return dim * _codebook(bits, dim)[1]


def rotation(dim: int, seed: int, device=None) -> torch.Tensor:
    """A Haar-random orthogonal ``[dim, dim]`` fp32 matrix from ``seed`` (same on every device:
    drawn on the CPU in float64, then moved)."""
    g = torch.Generator().manual_seed(int(seed))
    a = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(dim, dtype=torch.float64))
    return q.float().to(device)


def rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``x @ R^T`` in fp32 (x ``[..., D]``): the rotated space the codes live in."""
    return x.float() @ rot.t()


def quantize(x: torch.Tensor, rot: torch.Tensor, centroids: torch.Tensor, norm_dtype=torch.float32):
    """``x [..., D]`` -> ``(codes uint8 [..., D], norms [...] in norm_dtype)``: nearest centroid
    of each coordinate of the rotated direction (ties to the lower centroid)."""
    xf = x.float()
    norm = xf.norm(dim=-1)
    y = rotate(xf / torch.where(norm == 0, 1.0, norm).unsqueeze(-1), rot)
    bounds = (centroids[1:] + centroids[:-1]) / 2
    codes = torch.bucketize(y, bounds.to(y.device)).to(torch.uint8)  # y == bound -> the lower centroid
    return codes, norm.to(norm_dtype)


def dequantize(codes: torch.Tensor, norms: torch.Tensor, rot: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """``x_hat = |x| * (centroid[code] @ R)`` in fp32, ``[..., D]``."""
    return norms.float().unsqueeze(-1) * (centroids.to(codes.device)[codes.long()] @ rot)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes [..., C]`` (values < 2**bits) -> ``[..., C * bits // 8]`` uint8 (a little-endian
    bit stream, see the module docstring)."""
    c = codes.shape[-1]
    if (c * bits) % 8:
        raise ValueError(f"{c} codes of {bits} bits do not fill whole bytes")
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # [..., C, bits], low bit first
    stream = stream.reshape(*codes.shape[:-1], c * bits // 8, 8)
    weights = torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream << weights).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``[..., P]`` uint8 -> ``[..., count]`` uint8 codes."""
    weights = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32).unsqueeze(-1) >> weights) & 1  # [..., P, 8]
    stream = stream.reshape(*packed.shape[:-1], packed.shape[-1] * 8)[..., : count * bits]
    stream = stream.reshape(*packed.shape[:-1], count, bits)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream << shifts).sum(dim=-1).to(torch.uint8)


def turboquant_attention(q, k_codes, k_norms, v_codes, v_norms, rot, k_centroids, v_centroids, scale=None):
    """One decode query per query head over TurboQuant-coded keys and values, without
    dequantizing a key: ``q [Hq, D]``, codes ``[N, Hkv, D]``, norms ``[N, Hkv]``. Scores
    ``|k| * ((q @ R^T) . c_k[code])``, fp32 softmax, output ``(sum_j p_j |v_j| c_v[code_j]) @ R``
    in q's dtype (GQA: query head h reads KV head ``h // (Hq // Hkv)``)."""
    hq, d = q.shape
    hkv = k_codes.shape[1]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qr = rotate(q, rot).view(hkv, group, d)  # [Hkv, group, D]
    kc = k_centroids.to(q.device)[k_codes.long()] * k_norms.float().unsqueeze(-1)  # rotated keys [N, Hkv, D]
    logits = torch.einsum("hgd,nhd->hgn", qr, kc) * scale
    p = torch.softmax(logits, dim=-1)
    vc = v_centroids.to(q.device)[v_codes.long()] * v_norms.float().unsqueeze(-1)
    out = torch.einsum("hgn,nhd->hgd", p, vc) @ rot  # back from the rotated space once
    return out.reshape(hq, d).to(q.dtype)


# ------------------------------------------------------------------ blocks of G tokens (a store's unit)
#
# A request's quantized history is a list of blocks of G consecutive tokens (as KIVI's, quant.py),
# each token quantized on its own (TurboQuant needs no group statistics: G is only the storage
# unit); per layer::
#
#     codes [num_blocks, Hkv, G, D*b/8] uint8   (pack_bits of each token's D codes)
#     norms [num_blocks, Hkv, G]        fp16
#
# and the most recent tokens (the residual) stay full precision in the engine's pool, read at
# ``req_to_token[req_rows[b], :res_len[b]]``.


def quantize_blocks(x, rot, centroids, bits, group, norm_dtype=torch.float16):
    """``x [n*G, Hkv, D]`` -> ``(codes [n, Hkv, G, D*bits//8] uint8, norms [n, Hkv, G])``."""
    t, hkv, d = x.shape
    if group <= 0 or t % group:
        raise ValueError(f"{t} tokens are not a whole number of blocks of {group}")
    codes, norms = quantize(x, rot, centroids, norm_dtype)
    n = t // group
    packed = pack_bits(codes, bits).reshape(n, group, hkv, -1).transpose(1, 2).contiguous()
    return packed, norms.reshape(n, group, hkv).transpose(1, 2).contiguous()


def dequantize_blocks(codes, norms, rot, centroids, bits):
    """Inverse of ``quantize_blocks`` (up to the quantization): ``[n*G, Hkv, D]`` fp32."""
    n, hkv, group, packed = codes.shape
    d = packed * 8 // bits
    c = unpack_bits(codes, bits, d)  # [n, Hkv, G, D]
    x = dequantize(c, norms, rot, centroids)
    return x.transpose(1, 2).reshape(n * group, hkv, d)


def turboquant_decode_attention(q, k_codes, k_norms, v_codes, v_norms, rot, k_centroids, v_centroids,
                                block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len,
                                bits, scale=None):
    """Decode attention over TurboQuant blocks + a full-precision residual, q ``[B, Hq, D]``.
    The history is attended in the rotated space without dequantizing a key (scores from the
    rotated query, values summed there and rotated back once); the residual as usual; one fp32
    softmax over both (default scale ``1/sqrt(D)``). ``[B, Hq, D]`` in q's dtype; zeros for a
    request with nothing. ``k_centroids`` / ``v_centroids`` may differ (keys and values may use
    different bit widths: ``bits`` is then a pair ``(k_bits, v_bits)``)."""
    kb, vb = (bits, bits) if isinstance(bits, int) else bits
    b_, hq, d = q.shape
    hkv = k_cache.shape[1]
    group = hq // hkv
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b_, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_):
        row = int(req_rows[b])
        blocks = block_table[row, : int(n_blocks[b])].long()
        slots = req_to_token[row, : int(res_len[b])].long()
        qb = q[b].float().view(hkv, group, d)
        kc = unpack_bits(k_codes[blocks], kb, d).transpose(1, 2).reshape(-1, hkv, d)  # [n*G, Hkv, D]
        vc = unpack_bits(v_codes[blocks], vb, d).transpose(1, 2).reshape(-1, hkv, d)
        kn = k_norms[blocks].transpose(1, 2).reshape(-1, hkv).float()
        vn = v_norms[blocks].transpose(1, 2).reshape(-1, hkv).float()
        k_rot = k_centroids.to(q.device)[kc.long()] * kn.unsqueeze(-1)
        v_rot = v_centroids.to(q.device)[vc.long()] * vn.unsqueeze(-1)
        hist = torch.einsum("hgd,nhd->hgn", rotate(qb, rot), k_rot) * sc
        res = torch.einsum("hgd,nhd->hgn", qb, k_cache[slots].float()) * sc
        logits = torch.cat([hist, res], dim=-1)
        if logits.shape[-1] == 0:
            continue
        p = torch.softmax(logits, dim=-1)
        n = hist.shape[-1]
        o = torch.einsum("hgn,nhd->hgd", p[..., :n], v_rot) @ rot
        o = o + torch.einsum("hgn,nhd->hgd", p[..., n:], v_cache[slots].float())
        out[b] = o.reshape(hq, d)
    return out.to(q.dtype)
