"""FlashPrefill (Fan et al., 2026, "FlashPrefill v2"): block-sparse prefill attention, selected with
``--sparse-prefill flashprefill`` next to any ``--sparse-method`` (it owns no KV: decode is the
method's, dense by default).

For a prefill chunk of request i (logical positions ``[start, start + s)``, which are also its rows:
only requests whose rows are their positions are served sparsely, see below) and each layer: the
queries and keys are mean-pooled per ``block`` positions (blocks aligned to absolute positions),
each query head's pooled queries score its KV head's pooled keys (softmax over the causal key
blocks), and each query block keeps the ``sinks`` first key blocks, its own and the ``local - 1``
blocks before it, then further key blocks in descending softmax mass (ties to the lower block)
while the kept mass is below ``threshold`` and, if ``budget > 0``, fewer than ``budget`` blocks
are kept. Attention then reads only the kept blocks (causal by position inside them). Formulas:
``sgl_kernel_sparse.flashprefill`` (``block_mask``); kernel: ``triton_flashprefill`` on CUDA
(fp16 / bf16), the plain-torch reference elsewhere (``kernels/sparse_prefill.py``).

Choices the paper leaves open here (our defaults, documented, not the paper's tuned values):

- ``block`` 64 positions (a power of two >= 16: the Triton kernel's tile);
- ``threshold`` 0.9 of the block-softmax mass; 1.0 keeps every causal block (dense prefill,
  through the same kernel: exactly the dense result up to the kernel's summation order);
- ``budget`` 0 = no cap on the blocks kept per query block;
- ``sinks`` 1 block, ``local`` 2 blocks (the diagonal and the one before);
- ``min_len`` 4096: a chunk whose keys (earlier rows + itself) are fewer stays dense (short
  prompts gain nothing from a mask);
- GQA: the mask is per query head (each pools its own queries against its KV head's keys).

Served sparsely: prefill chunks of requests whose rows are their logical positions (no eviction,
no pruned or compacted prefix, no per-layer rows, no history in a method store). Others, and the
decode tokens of a mixed step, run the backend's dense kernel (or the method's own prefill path),
counted in ``prefill_dense_chunks``. Counters (``/sparse/stats``): ``prefill_sparse_chunks``
(chunk x layer), ``prefill_blocks_total`` (causal (query block, key block) pairs x query heads)
and ``prefill_blocks_kept``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.events import LayerInput
from sglang_sparse.core.prefill import PrefillPolicy
from sglang_sparse.core.views import BlockSparsePrefillView
from sglang_sparse.kernels.sparse_prefill import block_sparse_prefill, flashprefill_block_mask
from sglang_sparse.registry import ConfigError, register_prefill


@dataclass
class FlashPrefillConfig:
    block: int = 64
    threshold: float = 0.9
    budget: int = 0
    sinks: int = 1
    local: int = 2
    min_len: int = 4096

    def validate(self) -> None:
        b = int(self.block)
        if b < 16 or b & (b - 1):
            raise ConfigError(f"--sparse-prefill-block {self.block} is not allowed: must be a power of two >= 16")
        if not 0.0 < float(self.threshold) <= 1.0:
            raise ConfigError(f"--sparse-prefill-threshold {self.threshold} is out of range: must be in (0, 1]")
        for name, low in (("budget", 0), ("sinks", 0), ("local", 1), ("min_len", 0)):
            if int(getattr(self, name)) < low:
                raise ConfigError(f"--sparse-prefill-{name.replace('_', '-')} {getattr(self, name)} is out of "
                                  f"range: must be >= {low}")


def causal_pairs(s: int, start: int, block: int) -> int:
    """(query block, key block) pairs a chunk's causal mask holds, per query head."""
    first, last = start // block, (start + s - 1) // block
    return sum(a + 1 for a in range(first, last + 1))


@register_prefill("flashprefill", FlashPrefillConfig, "block-sparse prefill from pooled query/key block scores")
class FlashPrefill(PrefillPolicy):
    def view(self, layer: LayerInput, eligible: tuple[bool, ...]) -> BlockSparsePrefillView | None:
        c = self.config
        sparse = tuple(ok and r.row_start + r.num_tokens >= c.min_len
                       for ok, r in zip(eligible, layer.step.requests))
        self.counters["prefill_dense_chunks"] += sum(r.is_prefill and not sp
                                                     for sp, r in zip(sparse, layer.step.requests))
        return BlockSparsePrefillView(sparse, self.attend) if any(sparse) else None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
        c = self.config
        mask = flashprefill_block_mask(q, k, c.block, c.sinks, c.local, float(c.threshold), c.budget or None,
                                       start, scale)
        self.counters["prefill_sparse_chunks"] += 1
        self.counters["prefill_blocks_total"] += causal_pairs(q.shape[0], start, c.block) * q.shape[1]
        self.counters["prefill_blocks_kept"] += int(mask.sum())
        return block_sparse_prefill(q, k, v, mask, c.block, start, scale)
