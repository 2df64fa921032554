"""A method-owned quantized KV store: KIVI blocks (engine-agnostic, torch only).

The quantized history of a request is a list of *blocks* of G consecutive tokens; a block holds,
per layer and KV head, the packed codes and the scale / min of KIVI's groups
(``sgl_kernel_sparse.quant``: keys per channel over the block's G tokens, values per token over
groups of G channels). The full-precision residual stays in the engine's pool.

```
 logical  0 ............ nG-1 | nG ............ logical_len-1
          blocks b_0 .. b_{n-1}  | engine rows 0 .. n_rows-1 (full precision, the residual)
          block_table[req_row, j] = b_j           RoPE offset of the rows = nG (rows.py)
```

Per block and layer (b bits, KV heads H, head_dim D): codes ``2 * H * G * D * b / 8`` bytes and
four fp16 tensors (key scale/min ``H * D``, value scale/min ``H * G * D / G``):
``bytes_per_token = layers * H * (2 * D * b / 8 + 2 * 2 * D / G + 2 * 2 * D / G)``.
Scales and mins are fp16 (``kivi_quantize_groups(scale_dtype=fp16)`` computes the codes from
the rounded values, so the reconstruction is exact in the stored dtype).
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse.quant import (kivi_dequantize_keys, kivi_dequantize_values, kivi_quantize_keys,
                                     kivi_quantize_values)

SCALE_DTYPE = torch.float16


class QuantizedBlockStore:
    codec = "kivi"  # which decode kernel reads the blocks (``kernels.quantized.quantized_decode``)

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, bits: int,
                 group: int, device="cpu") -> None:
        self.num_layers, self.bits, self.group, self.num_blocks = num_layers, bits, group, num_blocks
        self._make_tensors(kv_heads, head_dim, device)
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        # holders per block: the request that wrote it, then every request, chain or radix node
        # that shares it (``ref``); a block is free again when the last one lets go (``free``)
        self._refs = [0] * num_blocks
        self.reclaim = None  # set by the engine adapter: fn(n) frees cached blocks, True if any went

    def _tensors(self, kv_heads: int, *shape, dtype, device) -> list[torch.Tensor]:
        """One ``[num_blocks, kv_heads, *shape]`` tensor per layer."""
        return [torch.zeros(self.num_blocks, kv_heads, *shape, dtype=dtype, device=device)
                for _ in range(self.num_layers)]

    def _make_tensors(self, kv_heads: int, head_dim: int, device) -> None:
        group, packed = self.group, head_dim * self.bits // 8
        self.k_codes = self._tensors(kv_heads, group, packed, dtype=torch.uint8, device=device)
        self.v_codes = self._tensors(kv_heads, group, packed, dtype=torch.uint8, device=device)
        self.k_scale = self._tensors(kv_heads, head_dim, dtype=SCALE_DTYPE, device=device)
        self.k_min = self._tensors(kv_heads, head_dim, dtype=SCALE_DTYPE, device=device)
        self.v_scale = self._tensors(kv_heads, group, head_dim // group, dtype=SCALE_DTYPE, device=device)
        self.v_min = self._tensors(kv_heads, group, head_dim // group, dtype=SCALE_DTYPE, device=device)

    @staticmethod
    def block_bytes(num_layers: int, kv_heads: int, head_dim: int, bits: int, group: int) -> int:
        """Bytes of one block: packed K and V codes + fp16 key scale/min per channel + fp16 value
        scale/min per token and channel group, over every layer and KV head."""
        codes = 2 * group * head_dim * bits // 8
        scales = 2 * 2 * head_dim + 2 * 2 * group * (head_dim // group)
        return num_layers * kv_heads * (codes + scales)

    # -- allocation ----------------------------------------------------------------------------
    def free_count(self) -> int:
        return len(self._free)

    def make_room(self, n: int) -> bool:
        """Whether ``n`` blocks are free, after asking ``reclaim`` (the radix cache's unlocked
        blocks) for the shortfall while it still frees some."""
        while len(self._free) < n and self.reclaim is not None and self.reclaim(n - len(self._free)):
            pass
        return len(self._free) >= n

    def alloc(self, n: int) -> list[int] | None:
        """n blocks (one holder each), or None if fewer are free even after ``make_room``."""
        if not self.make_room(n):
            return None
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def ref(self, blocks) -> None:
        """One more holder for each of ``blocks`` (all in use)."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise RuntimeError(f"KIVI block {b} is shared but not allocated")
            self._refs[b] += 1

    def free(self, blocks) -> None:
        """One holder fewer for each of ``blocks``; a block nobody holds is free again."""
        blocks = [int(b) for b in blocks]
        if len(set(blocks)) != len(blocks) or any(self._refs[b] <= 0 for b in blocks):
            raise RuntimeError(f"double free of KIVI blocks {blocks}")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def holders(self, block: int) -> int:
        return self._refs[block]

    # -- writes --------------------------------------------------------------------------------
    def write(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize ``len(blocks) * G`` consecutive tokens' K and V (``[n*G, H, D]``) into blocks."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k_codes[layer].device)
        kc, ks, km = kivi_quantize_keys(k, self.bits, self.group, scale_dtype=SCALE_DTYPE)
        vc, vs, vm = kivi_quantize_values(v, self.bits, self.group, scale_dtype=SCALE_DTYPE)
        self.k_codes[layer][idx], self.k_scale[layer][idx], self.k_min[layer][idx] = kc, ks, km
        self.v_codes[layer][idx], self.v_scale[layer][idx], self.v_min[layer][idx] = vc, vs, vm

    def read(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V (fp32 ``[len(blocks) * G, H, D]``, blocks in the order given) of
        one layer: what a prefill chunk attends of a quantized history."""
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.k_codes[layer].device)
        kc, ks, km, vc, vs, vm = (t[idx] for t in self.layer(layer))
        return kivi_dequantize_keys(kc, ks, km, self.bits), kivi_dequantize_values(vc, vs, vm, self.bits)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``(k_codes, k_scale, k_min, v_codes, v_scale, v_min)`` of one layer (kernel order)."""
        return (self.k_codes[layer], self.k_scale[layer], self.k_min[layer],
                self.v_codes[layer], self.v_scale[layer], self.v_min[layer])

    # -- bytes ---------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return sum(t[0].nbytes for layer in range(self.num_layers) for t in self.layer(layer))

    def bytes_per_token(self) -> float:
        return self.bytes_per_block() / self.group
