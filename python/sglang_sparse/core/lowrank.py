"""Low-rank factors of a layer's K and V projections (Palu), engine-agnostic, torch only.

Per layer, the key projection ``W_k [H*d, hidden]`` (and likewise ``W_v``) is cut into groups of
``head_group`` KV heads (g = 1: Palu's M-LRD, one factor per head; g = H: J-LRD; between: G-LRD),
and each group's ``W_g [g*d, hidden]`` is factored by a truncated SVD, whitened by the layer's
calibration inputs X (SVD-LLM)::

    X^T X = S^T S                     (S upper triangular: Cholesky, ``whitening``; S = I unwhitened)
    S W_g^T = U diag(sigma) V^T       (full SVD, sigma descending)
    A_g = S^-1 U_r diag(sigma_r)^1/2    [hidden, r]
    B_g = diag(sigma_r)^1/2 V_r^T       [r, g*d]

so that ``||X (W_g^T - A_g B_g)||_F^2 = sum_{i>r} sigma_i^2`` (Eckart-Young on ``S W_g^T``: the
best rank-r approximation of the layer's outputs on X). Rank r from the compression ratio:
``r = round((1 - ratio) * g * d)`` per group, the same for K and V and every layer
(``ranks_for_ratio``); ratio 0 is full rank (``A_g B_g = W_g^T`` up to rounding).

The factors of every rank are prefixes of the full-rank ones (``A[:, :r]``, ``B[:r]``), so the
artifact cached on disk holds the full factorisation (``full_factors``) and ``PaluFactors.
from_full`` cuts it to the configured rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def ranks_for_ratio(ratio: float, kv_heads: int, head_dim: int, head_group: int) -> tuple[int, int]:
    """``(rank per group, number of groups)`` for a compression ratio in [0, 1): the latent keeps
    ``1 - ratio`` of a group's ``head_group * head_dim`` channels, rounded half up, at least 1."""
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio={ratio} is out of range: must be in [0, 1)")
    if head_group < 1 or kv_heads % head_group:
        raise ValueError(f"head_group={head_group} must divide the model's {kv_heads} KV heads")
    width = head_group * head_dim
    rank = int((1.0 - ratio) * width + 0.5)
    return max(1, min(width, rank)), kv_heads // head_group


def whitening(gram: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Upper-triangular S with ``S^T S = gram`` (float64): the Cholesky factor of ``X^T X``; if
    the Gram matrix is singular, ``eps * mean(diag) * I`` is added (eps x10 until it factors)."""
    g = gram.double()
    g = (g + g.t()) / 2
    damp, eye = 0.0, torch.eye(g.shape[0], dtype=torch.float64, device=g.device)
    scale = float(g.diagonal().mean().clamp_min(1e-30))
    for _ in range(12):
        lower, info = torch.linalg.cholesky_ex(g + damp * scale * eye)
        if int(info) == 0:
            return lower.t().contiguous()
        damp = eps if damp == 0.0 else damp * 10
    raise ValueError("the calibration Gram matrix cannot be factored (not positive definite)")


def factor(w: torch.Tensor, s: torch.Tensor | None, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``W [out, hidden]`` -> ``(A [hidden, rank], B [rank, out], sigma [min(hidden, out)])``
    (float64) with ``A B`` the whitened rank-``rank`` approximation of ``W^T`` (module docstring);
    ``s`` None: plain SVD (S = I)."""
    wt = w.double().t()
    m = wt if s is None else s.double() @ wt
    u, sigma, vh = torch.linalg.svd(m, full_matrices=False)
    root = sigma[:rank].sqrt()
    left = u[:, :rank] * root
    a = left if s is None else torch.linalg.solve_triangular(s.double(), left, upper=True)
    return a, root.unsqueeze(1) * vh[:rank], sigma


def full_factors(wk: torch.Tensor, wv: torch.Tensor, s: torch.Tensor | None, head_group: int,
                 head_dim: int) -> dict[str, torch.Tensor]:
    """One layer's full-rank factors per group (float32): ``a_k / a_v [n_groups, hidden, g*d]``,
    ``b_k / b_v [n_groups, g*d, g*d]``, ``sigma_k / sigma_v [n_groups, g*d]``."""
    width = head_group * head_dim
    out = {}
    for kind, w in (("k", wk), ("v", wv)):
        if w.shape[0] % width:
            raise ValueError(f"W_{kind} has {w.shape[0]} rows: not whole groups of {head_group} heads of {head_dim}")
        parts = [factor(w[i: i + width], s, width) for i in range(0, w.shape[0], width)]
        out[f"a_{kind}"] = torch.stack([p[0] for p in parts]).float()
        out[f"b_{kind}"] = torch.stack([p[1] for p in parts]).float()
        out[f"sigma_{kind}"] = torch.stack([p[2][:width] for p in parts]).float()
    return out


def tail_energy(sigma: torch.Tensor, rank: int) -> float:
    """Share of ``sum sigma^2`` beyond the first ``rank`` values (the whitened relative error^2)."""
    e = sigma.double() ** 2
    return float(e[..., rank:].sum() / e.sum().clamp_min(1e-300))


@dataclass
class PaluFactors:
    """The factors the server runs with, cut to one rank (per layer lists, fp32 unless moved):

    - ``a [hidden, 2 * n_groups * rank]``: the latents of a token are ``x @ a`` (K groups first,
      then V groups; group gi's columns ``[gi*r, (gi+1)*r)`` of its half);
    - ``bk / bv [n_groups, rank, g*d]`` and their pseudo-inverses ``pinv_k / pinv_v [n_groups, g*d,
      rank]`` (the store recovers latents from pool rows with them);
    - ``bias_k / bias_v [H*d]`` or None: the projection's bias (added after the reconstruction).
    """

    rank: int
    n_groups: int
    head_group: int
    head_dim: int
    a: list[torch.Tensor]
    bk: list[torch.Tensor]
    bv: list[torch.Tensor]
    pinv_k: list[torch.Tensor]
    pinv_v: list[torch.Tensor]
    bias_k: list[torch.Tensor | None] = field(default_factory=list)
    bias_v: list[torch.Tensor | None] = field(default_factory=list)

    @property
    def num_layers(self) -> int:
        return len(self.a)

    @classmethod
    def from_full(cls, layers: list[dict[str, torch.Tensor]], rank: int, head_group: int,
                  head_dim: int) -> PaluFactors:
        """Cut every layer's full factors (``full_factors``) to ``rank``."""
        a, bk, bv, pk, pv = [], [], [], [], []
        n_groups = layers[0]["a_k"].shape[0]
        for t in layers:
            ak, av = t["a_k"][:, :, :rank], t["a_v"][:, :, :rank]  # [ng, hidden, r]
            a.append(torch.cat([ak.permute(1, 0, 2).reshape(ak.shape[1], -1),
                                av.permute(1, 0, 2).reshape(av.shape[1], -1)], dim=1).contiguous())
            for src, b_out, p_out in ((t["b_k"], bk, pk), (t["b_v"], bv, pv)):
                b = src[:, :rank].contiguous().float()
                b_out.append(b)
                p_out.append(torch.linalg.pinv(b.double()).float())
        none = [None] * len(layers)
        return cls(rank, n_groups, head_group, head_dim, a, bk, bv, pk, pv, list(none), list(none))

    def with_key_gain(self, gains: list[torch.Tensor]) -> PaluFactors:
        """The factors of what reaches the pool when a per-head RMSNorm with weight ``gains[layer]
        [d]`` (Qwen3's ``k_norm``) sits between the projection and RoPE, for per-head groups
        (g = 1): the norm turns ``h B`` into ``gain * (h B) / rms(h B)``, which is ``h' (B
        diag(gain))`` with the per-token latent ``h' = h / rms``, so the store recovers and
        reconstructs keys with ``B diag(gain)`` and its pseudo-inverse (values are untouched)."""
        if self.head_group != 1:
            raise ValueError("a per-head key norm keeps the keys in the span of B only with per-head factors")
        bk = [b * g.float().to(b.device) for b, g in zip(self.bk, gains)]
        pk = [torch.linalg.pinv(b.double()).float() for b in bk]
        return PaluFactors(self.rank, self.n_groups, self.head_group, self.head_dim, self.a, bk, self.bv, pk,
                           self.pinv_v, self.bias_k, self.bias_v)

    def shard(self, rank: int, size: int) -> PaluFactors:
        """Tensor-parallel rank ``rank`` of ``size``: the factors of its KV heads, groups
        ``[rank*n, (rank+1)*n)`` with ``n = n_groups / size`` (SGLang gives rank r heads
        ``[r*h, (r+1)*h)``; the caller checked that groups do not straddle ranks). ``a``'s K and V
        halves each keep those groups' columns; biases are set afterwards from the rank's own
        projection."""
        if size == 1:
            return self
        n, r = self.n_groups // size, self.rank
        cols = torch.arange(rank * n * r, (rank + 1) * n * r)
        half = self.n_groups * r
        pick = lambda xs: [x[rank * n: (rank + 1) * n].contiguous() for x in xs]  # noqa: E731
        a = [x[:, torch.cat([cols, cols + half])].contiguous() for x in self.a]
        none = [None] * self.num_layers
        return PaluFactors(r, n, self.head_group, self.head_dim, a, pick(self.bk), pick(self.bv), pick(self.pinv_k),
                           pick(self.pinv_v), list(none), list(none))

    def to(self, device) -> PaluFactors:
        mv = lambda xs: [None if x is None else x.to(device) for x in xs]  # noqa: E731
        return PaluFactors(self.rank, self.n_groups, self.head_group, self.head_dim, mv(self.a), mv(self.bk),
                           mv(self.bv), mv(self.pinv_k), mv(self.pinv_v), mv(self.bias_k), mv(self.bias_v))

    def block_diag(self, layer: int, kind: str) -> torch.Tensor:
        """``[n_groups * rank, H*d]``: the groups' B on the diagonal (one matmul reconstructs all
        heads from the concatenated latents)."""
        b = self.bk[layer] if kind == "k" else self.bv[layer]
        return torch.block_diag(*b.unbind(0))

    def bytes(self) -> int:
        """Bytes of the factors the server holds (not KV: reported apart)."""
        return sum(t.nbytes for xs in (self.a, self.bk, self.bv, self.pinv_k, self.pinv_v) for t in xs)


@dataclass(frozen=True)
class RopeTable:
    """The model's RoPE: ``cos_sin [max_pos, rotary_dim]`` (cos then sin of each frequency) and
    the style (neox halves or GPT-J pairs)."""

    cos_sin: torch.Tensor
    neox: bool


@dataclass(frozen=True)
class LatentModel:
    """What the engine's projection hook hands a ``projects_kv`` runtime (``bind_model``): the
    factors cut to the configured rank (with the model's biases) and the model's RoPE table."""

    factors: PaluFactors
    rope: RopeTable
