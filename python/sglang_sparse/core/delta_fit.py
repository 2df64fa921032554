"""DeltaKV's linear compressor, fitted by this project (engine-agnostic, torch only).

The paper trains ``down`` / ``up`` on the frozen LLM (reconstruction + next-token loss); no such
compressor exists for the default model here, so the project fits the linear one that minimises
the *reconstruction MSE* of the residuals ``r = kv - base`` (``sgl_kernel_sparse.deltakv``):
the centred PCA, i.e. the MSE-optimal linear autoencoder of width m::

    mu = E[r]      C = E[(r - mu)(r - mu)^T] = U diag(lambda) U^T     (eigh, lambda descending)
    down = U_m^T   up = U_m   b_up = (I - U_m U_m^T) mu

so that ``up(down(kv) - down(base)) + base = base + mu + U_m U_m^T (r - mu)`` (the rank-m PCA
reconstruction of r; error = the dropped eigenvalues). At ``m = W`` it is exact. Every m is a
prefix of the full basis (``DeltaCompressor.from_basis``), so the full basis is what is cached.

Residuals for the fit (``sequence_residuals``): one sequence's pre-RoPE K/V at positions
``0..n-1``, references at positions ``p % stride == 0`` (the runtime's rule: blocks start at
multiples of G and ``stride | G``), fathers among references at positions <= t; references'
own residuals are not fitted (they are stored exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse.deltakv import assign_fathers, base_of, causal_mask, kv_vectors


@dataclass
class DeltaCompressor:
    """Per layer: ``down [m, W]``, ``up [W, m]``, ``b_up [W]`` (fp32 unless moved)."""

    down: list[torch.Tensor]
    up: list[torch.Tensor]
    b_up: list[torch.Tensor]

    @property
    def num_layers(self) -> int:
        return len(self.down)

    @property
    def latent(self) -> int:
        return self.down[0].shape[0]

    @property
    def width(self) -> int:
        return self.down[0].shape[1]

    @classmethod
    def from_basis(cls, bases: list[torch.Tensor], means: list[torch.Tensor], m: int) -> DeltaCompressor:
        """Cut each layer's full basis ``[W, W]`` (columns by descending variance) to m."""
        down, up, b_up = [], [], []
        for u, mu in zip(bases, means):
            um = u[:, :m].double()
            mu = mu.double()
            down.append(um.t().float().contiguous())
            up.append(um.float().contiguous())
            b_up.append((mu - um @ (um.t() @ mu)).float())
        return cls(down, up, b_up)

    def to(self, device) -> DeltaCompressor:
        return DeltaCompressor([t.to(device) for t in self.down], [t.to(device) for t in self.up],
                               [t.to(device) for t in self.b_up])

    def bytes(self) -> int:
        return sum(t.nbytes for xs in (self.down, self.up, self.b_up) for t in xs)


class Moments:
    """Running count, sum and ``sum r r^T`` (fp64) of residual rows, for ``pca``."""

    def __init__(self) -> None:
        self.total, self.s1, self.s2 = 0, None, None

    def add(self, r: torch.Tensor) -> None:
        r = r.double().reshape(-1, r.shape[-1])
        self.total += r.shape[0]
        self.s1 = r.sum(0) if self.s1 is None else self.s1 + r.sum(0)
        self.s2 = r.t() @ r if self.s2 is None else self.s2 + r.t() @ r

    def pca(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(basis [W, W] (columns by descending eigenvalue), mean [W], eigenvalues [W]
        descending)``, fp64."""
        if not self.total:
            raise ValueError("no residuals to fit")
        mu = self.s1 / self.total
        cov = self.s2 / self.total - torch.outer(mu, mu)
        lam, u = torch.linalg.eigh((cov + cov.t()) / 2)
        return u.flip(1).contiguous(), mu, lam.flip(0).clamp_min(0)


def pca_basis(residuals) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centred PCA of the rows of every ``[n, W]`` tensor ``residuals`` yields (``Moments.pca``)."""
    m = Moments()
    for r in residuals:
        m.add(r)
    return m.pca()


def tail_share(eigvals: torch.Tensor, m: int) -> float:
    """Share of the residuals' variance a width-m compressor drops (its relative MSE)."""
    e = eigvals.double()
    return float(e[m:].sum() / e.sum().clamp_min(1e-300))


def fit_linear_compressor(residuals, m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(down [m, W], up [W, m], b_up [W])`` fp32: the MSE-optimal linear autoencoder of width m."""
    u, mu, _ = pca_basis(residuals)
    c = DeltaCompressor.from_basis([u], [mu], m)
    return c.down[0], c.up[0], c.b_up[0]


def sequence_residuals(k: torch.Tensor, v: torch.Tensor, stride: int, neighbors: int, metric: str) -> torch.Tensor:
    """Residuals ``kv - base`` ``[n_non_ref, W]`` fp32 of one sequence's pre-RoPE ``k / v [n, H, d]``
    at positions ``0..n-1`` (the runtime's reference rule; module docstring)."""
    kv = kv_vectors(k, v)
    n, hd = kv.shape[0], k.shape[1] * k.shape[2]
    refs = kv[::stride]  # ordinal q = position q * stride
    fathers = assign_fathers(kv[:, :hd], refs[:, :hd], causal_mask(0, n, refs.shape[0], stride, kv.device),
                             neighbors, metric)
    keep = torch.arange(n, device=kv.device) % stride != 0
    return (kv - base_of(fathers, refs))[keep]
