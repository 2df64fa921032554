"""A method-owned block store of TurboQuant codes (engine-agnostic, torch only).

Same blocks, allocation and sharing as KIVI's store (``core/quant_store``: blocks of G
consecutive tokens, refcounted, reclaimable by the radix cache); what a block holds differs.
TurboQuant quantizes each token's key and value on its own (``sgl_kernel_sparse.turboquant``):
per layer and KV head, the b-bit codes of the rotated direction and the fp16 norm::

    k_codes / v_codes [num_blocks, Hkv, G, D*b/8] uint8     k_norm / v_norm [num_blocks, Hkv, G] fp16

One seeded rotation R ``[D, D]`` and one codebook (the Lloyd-Max centroids for dimension D) serve
every layer and head, keys and values: ``bytes_per_token = layers * Hkv * 2 * (D*b/8 + 2)``.
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse.turboquant import codebook, dequantize_blocks, quantize_blocks, rotation

from sglang_sparse.core.quant_store import SCALE_DTYPE, QuantizedBlockStore


class TurboQuantBlockStore(QuantizedBlockStore):
    codec = "turboquant"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, bits: int,
                 group: int, seed: int, device="cpu") -> None:
        self.rot = rotation(head_dim, seed, device=device)
        self.centroids = codebook(bits, head_dim, device=device)
        super().__init__(num_layers, kv_heads, head_dim, num_blocks, bits, group, device)

    def _make_tensors(self, kv_heads: int, head_dim: int, device) -> None:
        group, packed = self.group, head_dim * self.bits // 8
        self.k_codes = self._tensors(kv_heads, group, packed, dtype=torch.uint8, device=device)
        self.v_codes = self._tensors(kv_heads, group, packed, dtype=torch.uint8, device=device)
        self.k_norm = self._tensors(kv_heads, group, dtype=SCALE_DTYPE, device=device)
        self.v_norm = self._tensors(kv_heads, group, dtype=SCALE_DTYPE, device=device)

    @staticmethod
    def block_bytes(num_layers: int, kv_heads: int, head_dim: int, bits: int, group: int) -> int:
        """Bytes of one block: packed K and V codes + an fp16 norm per token, KV head and K/V."""
        return num_layers * kv_heads * 2 * group * (head_dim * bits // 8 + 2)

    def write(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``len(blocks) * G`` consecutive tokens' K and V (``[n*G, H, D]``) into blocks."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k_codes[layer].device)
        kc, kn = quantize_blocks(k, self.rot, self.centroids, self.bits, self.group, SCALE_DTYPE)
        vc, vn = quantize_blocks(v, self.rot, self.centroids, self.bits, self.group, SCALE_DTYPE)
        self.k_codes[layer][idx], self.k_norm[layer][idx] = kc, kn
        self.v_codes[layer][idx], self.v_norm[layer][idx] = vc, vn

    def read(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V (fp32 ``[len(blocks) * G, H, D]``) of one layer."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k_codes[layer].device)
        kc, kn, vc, vn = (t[idx] for t in self.layer(layer))
        return (dequantize_blocks(kc, kn, self.rot, self.centroids, self.bits),
                dequantize_blocks(vc, vn, self.rot, self.centroids, self.bits))

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``(k_codes, k_norm, v_codes, v_norm)`` of one layer (kernel order)."""
        return self.k_codes[layer], self.k_norm[layer], self.v_codes[layer], self.v_norm[layer]
