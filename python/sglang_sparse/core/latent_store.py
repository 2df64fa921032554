"""A method-owned block store of Palu latents (engine-agnostic, torch only).

Same blocks, allocation and sharing as KIVI's store (``core/quant_store``: blocks of G consecutive
tokens, refcounted, reclaimable by the radix cache); a block holds, per layer, the low-rank latents
of its tokens' keys and values (``sgl_kernel_sparse.palu``)::

    lat_k / lat_v [num_blocks, n_groups, G, rank]     in the engine pool's dtype

``bytes_per_token = layers * 2 * n_groups * rank * itemsize``: exactly ``rank / (g * d)`` of the
engine's own KV bytes per token (the latent keeps the pool's precision).

The latents are *recovered from the pool rows* the runtime moves into blocks (no side buffer):
the model wrote ``RoPE_pos(h B + b)`` (its qkv projection is replaced by the low-rank one,
``srt/engine/projection.py``), so ``h = (RoPE_pos^-1(row) - b) pinv(B)`` per group, exact up to the
pool's rounding. ``read`` reconstructs K (rotated at the block's logical positions) and V.
``max_residual`` is the largest relative distance seen between a row and the span of B (0 up to
rounding when every row came through the projection; a different KV writer would show here).
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse.palu import latent_blocks, reconstruct_blocks, recover_latents, rope_invert

from sglang_sparse.core.lowrank import PaluFactors, RopeTable
from sglang_sparse.core.quant_store import QuantizedBlockStore


class PaluLatentStore(QuantizedBlockStore):
    codec = "palu"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, rank: int, n_groups: int,
                 group: int, dtype=torch.float16, device="cpu") -> None:
        self.rank, self.n_groups, self.dtype = rank, n_groups, dtype
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.factors: PaluFactors | None = None  # bound once the model is loaded (``bind``)
        self.rope: RopeTable | None = None
        self.max_residual = 0.0
        super().__init__(num_layers, kv_heads, head_dim, num_blocks, 0, group, device)

    def _make_tensors(self, kv_heads: int, head_dim: int, device) -> None:
        self.lat_k = self._tensors(self.n_groups, self.group, self.rank, dtype=self.dtype, device=device)
        self.lat_v = self._tensors(self.n_groups, self.group, self.rank, dtype=self.dtype, device=device)

    @staticmethod
    def latent_block_bytes(num_layers: int, n_groups: int, rank: int, group: int, itemsize: int) -> int:
        """Bytes of one block: K and V latents of G tokens, every layer and group."""
        return num_layers * 2 * n_groups * group * rank * itemsize

    def bind(self, factors: PaluFactors, rope: RopeTable) -> None:
        """The model's factors (cut to this store's rank) and RoPE table."""
        if (factors.rank, factors.n_groups, factors.num_layers) != (self.rank, self.n_groups, self.num_layers):
            raise ValueError(f"factors of rank {factors.rank} x {factors.n_groups} groups x {factors.num_layers} "
                             f"layers do not fit a store of rank {self.rank} x {self.n_groups} x {self.num_layers}")
        device = self.lat_k[0].device
        self.factors = factors.to(device)
        self.rope = RopeTable(rope.cos_sin.to(device), rope.neox)

    def _need_factors(self) -> PaluFactors:
        if self.factors is None or self.rope is None:
            raise RuntimeError("the Palu store has no factors bound (the model hook did not run)")
        return self.factors

    def write(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Store ``len(blocks) * G`` consecutive tokens' latents, recovered from their pool rows
        ``k`` (rotated at logical positions ``start + [0, n*G)``) and ``v`` ``[n*G, H, d]``."""
        f = self._need_factors()
        pos = torch.arange(start, start + k.shape[0], device=k.device)
        k_pre = rope_invert(k, self.rope.cos_sin, pos, self.rope.neox)
        hk = recover_latents(k_pre, f.pinv_k[layer], f.bias_k[layer])
        hv = recover_latents(v, f.pinv_v[layer], f.bias_v[layer])
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.lat_k[layer].device)
        self.lat_k[layer][idx] = latent_blocks(hk, self.group).to(self.dtype)
        self.lat_v[layer][idx] = latent_blocks(hv, self.group).to(self.dtype)
        # distance of the rows from the span of B (both K and V), relative
        back_k = torch.einsum("ngr,grc->ngc", hk, f.bk[layer]).reshape(k.shape[0], -1)
        back_v = torch.einsum("ngr,grc->ngc", hv, f.bv[layer]).reshape(v.shape[0], -1)
        bk = 0 if f.bias_k[layer] is None else f.bias_k[layer].float()
        bv = 0 if f.bias_v[layer] is None else f.bias_v[layer].float()
        for got, row in ((back_k + bk, k_pre), (back_v + bv, v.float())):
            row = row.reshape(row.shape[0], -1)
            if row.numel():
                self.max_residual = max(self.max_residual,
                                        float((got - row).norm() / row.norm().clamp_min(1e-30)))

    def read(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed K (rotated at logical positions ``[0, n*G)``, blocks in the order given)
        and V, fp32 ``[len(blocks) * G, H, d]``: what a prefill chunk attends of the history."""
        f = self._need_factors()
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.lat_k[layer].device)
        return reconstruct_blocks(self.lat_k[layer][idx], self.lat_v[layer][idx], f.bk[layer], f.bv[layer],
                                  f.bias_k[layer], f.bias_v[layer], self.rope.cos_sin, self.rope.neox, self.head_dim)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``(lat_k, lat_v)`` of one layer."""
        return self.lat_k[layer], self.lat_v[layer]
