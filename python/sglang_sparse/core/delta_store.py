"""A method-owned block store of DeltaKV codes (engine-agnostic, torch only).

Same blocks, allocation and sharing as KIVI's store (``core/quant_store``: blocks of G consecutive
tokens, refcounted, reclaimable by the radix cache); a block holds, per layer
(``sgl_kernel_sparse.deltakv`` has the formulas; W = 2 H d)::

    codes   [num_blocks, G, m]            residual codes, in the engine pool's dtype
    fathers [num_blocks, G, neighbors]    int32 reference ordinals of the request (-1: none)
    refs    [num_blocks, G/stride, W]     pre-RoPE K|V of the block's references (offsets
                                          0, stride, ...), exact in the pool's dtype

``bytes_per_token = layers * (m * itemsize + neighbors * 4 + W * itemsize / stride)`` (5,760 B on
the default model in fp16 at m 64, stride 16, neighbors 4; its own KV is 23,040).

``write`` takes the pool rows of whole blocks (K rotated at their logical positions) and
recovers the pre-RoPE K with the model's RoPE table (``rope_invert``: exact up to the pool's
rounding); the fathers of the new tokens are searched among the request's earlier references
(``prior`` blocks, gathered here) and the new blocks' own references at positions <= t, so the
ordinals of a block only reach into its prefix of blocks. ``read`` reconstructs a request's
blocks (given from its block 0: ordinals index them in that order).
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse.deltakv import (assign_fathers, base_of, causal_mask, encode, kv_vectors, reconstruct_blocks,
                                       ref_offsets)
from sgl_kernel_sparse.palu import rope_invert

from sglang_sparse.core.delta_fit import DeltaCompressor
from sglang_sparse.core.lowrank import RopeTable
from sglang_sparse.core.quant_store import QuantizedBlockStore


class DeltaBlockStore(QuantizedBlockStore):
    codec = "deltakv"

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, latent: int, stride: int,
                 neighbors: int, metric: str, group: int, dtype=torch.float16, device="cpu") -> None:
        if group % stride:
            raise ValueError(f"stride {stride} must divide the block of {group} tokens")
        self.latent, self.stride, self.neighbors, self.metric, self.dtype = latent, stride, neighbors, metric, dtype
        self.kv_heads, self.head_dim, self.width = kv_heads, head_dim, 2 * kv_heads * head_dim
        self.compressor: DeltaCompressor | None = None  # bound once the model is loaded (``bind``)
        self.rope: RopeTable | None = None
        super().__init__(num_layers, kv_heads, head_dim, num_blocks, 0, group, device)

    def _make_tensors(self, kv_heads: int, head_dim: int, device) -> None:
        n, g, per = self.num_blocks, self.group, self.group // self.stride
        layers = range(self.num_layers)
        self.codes = [torch.zeros(n, g, self.latent, dtype=self.dtype, device=device) for _ in layers]
        self.fathers = [torch.full((n, g, self.neighbors), -1, dtype=torch.int32, device=device) for _ in layers]
        self.refs = [torch.zeros(n, per, self.width, dtype=self.dtype, device=device) for _ in layers]

    @staticmethod
    def delta_block_bytes(num_layers: int, width: int, latent: int, stride: int, neighbors: int, group: int,
                          itemsize: int) -> int:
        """Bytes of one block: codes, fathers (int32) and references of G tokens, every layer."""
        return num_layers * (group * latent * itemsize + group * neighbors * 4 + group // stride * width * itemsize)

    def bind(self, compressor: DeltaCompressor, rope: RopeTable) -> None:
        """The fitted compressor (cut to this store's latent size) and the model's RoPE table."""
        if (compressor.num_layers, compressor.latent, compressor.width) != (self.num_layers, self.latent, self.width):
            raise ValueError(f"a compressor of {compressor.num_layers} layers x {compressor.latent} x "
                             f"{compressor.width} does not fit a store of {self.num_layers} x {self.latent} x "
                             f"{self.width}")
        device = self.codes[0].device
        self.compressor = compressor.to(device)
        self.rope = RopeTable(rope.cos_sin.to(device), rope.neox)

    def _need(self) -> DeltaCompressor:
        if self.compressor is None or self.rope is None:
            raise RuntimeError("the DeltaKV store has no compressor bound (bind_model did not run)")
        return self.compressor

    def write(self, layer: int, blocks: list[int], k: torch.Tensor, v: torch.Tensor, prior: list[int]) -> None:
        """Code ``len(blocks) * G`` consecutive tokens from their pool rows ``k`` (rotated at
        logical positions ``len(prior) * G + [0, n*G)``) and ``v`` ``[n*G, H, d]``; ``prior``: the
        request's earlier blocks, in order (their references are candidates)."""
        c, g, per = self._need(), self.group, self.group // self.stride
        start, count, hd = len(prior) * g, k.shape[0], self.width // 2
        dev = self.codes[layer].device
        pos = torch.arange(start, start + count, device=k.device)
        kv = kv_vectors(rope_invert(k, self.rope.cos_sin, pos, self.rope.neox), v)  # pre-RoPE, [count, W]
        nb = count // g
        # new references (offsets 0, stride, ... of each new block), rounded as they are stored
        at = (torch.arange(nb, device=kv.device)[:, None] * g + ref_offsets(g, self.stride, kv.device)[None])
        new_refs = kv[at.reshape(-1)].to(self.dtype)  # [nb * per, W]
        old = self.refs[layer][torch.tensor(prior, dtype=torch.int64, device=dev)].reshape(-1, self.width)
        refs = torch.cat([old.to(kv.device), new_refs]).float()  # request ordinals 0 .. (len(prior)+nb)*per - 1
        fathers = assign_fathers(kv[:, :hd], refs[:, :hd], causal_mask(start, count, refs.shape[0], self.stride,
                                                                        kv.device), self.neighbors, self.metric)
        code = encode(kv, base_of(fathers, refs), c.down[layer])
        idx = torch.tensor(blocks, dtype=torch.int64, device=dev)
        self.codes[layer][idx] = code.reshape(nb, g, -1).to(self.dtype)
        self.fathers[layer][idx] = fathers.reshape(nb, g, -1).to(torch.int32)
        self.refs[layer][idx] = new_refs.reshape(nb, per, -1)

    def read(self, layer: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Reconstructed K (rotated at logical ``[0, n*G)``) and V, fp32 ``[len(blocks) * G, H, d]``,
        of a request's blocks from its block 0: what a prefill chunk attends of the history."""
        c = self._need()
        idx = torch.tensor(blocks, dtype=torch.int64, device=self.codes[layer].device)
        return reconstruct_blocks(self.codes[layer][idx], self.fathers[layer][idx], self.refs[layer][idx],
                                  c.up[layer], c.b_up[layer], self.rope.cos_sin, self.rope.neox, self.kv_heads,
                                  self.head_dim)

    def layer(self, layer: int) -> tuple[torch.Tensor, ...]:
        """``(codes, fathers, refs)`` of one layer."""
        return self.codes[layer], self.fathers[layer], self.refs[layer]
