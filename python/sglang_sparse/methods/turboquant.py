"""TurboQuant (Zandieh et al., ICLR 2026): each token's key and value stored as an fp16 norm and
the b-bit codes (b = 2, 3 or 4) of its direction after a seeded random rotation, one Lloyd-Max
codebook for every coordinate (``sgl_kernel_sparse.turboquant``: the formulas, the codebook and
its expected error). Attention rotates the query once per head and reads the codes directly
(``turboquant_decode_attention``): scores ``|k| * ((q @ R^T) . c[code])``, values summed in the
rotated space and rotated back once.

It runs on KIVI's machinery (``methods/kivi.py``, whose docstring holds the details): a
method-owned store of blocks of G tokens (``core/turboquant_store``) split from the pool SGLang
sizes (``fp_fraction`` of its bytes stay full-precision slots), the most recent ``residual`` to
``residual + G - 1`` tokens full precision in SGLang's pool, whole groups past them quantized at
the safe point after the prompt and while decoding, admission by blocks, Chain Cache (a chain
owns its blocks), the radix cache keeping finished requests' blocks, ``/prune`` a 409.

Choices of this implementation (the paper quantizes every token as it arrives; it leaves the rest
to the implementation):

- the MSE quantizer only (TurboQuant_mse); the paper's inner-product variant adds a 1-bit QJL
  code of the residual and is not built;
- the storage unit is a block of G tokens (quantized when whole; each token on its own), so the
  newest ``residual`` .. ``residual + G - 1`` tokens stay full precision (defaults 32 and 32);
- keys and values share one rotation (seed ``seed``) and one b-bit codebook; the paper's
  outlier-channel split (more bits for some channels, its 2.5 / 3.5-bit settings) is not built;
- norms are fp16; a zero vector is stored as norm 0 (reconstructed exactly);
- decode over the codes runs in the Triton kernel on CUDA (``sgl_kernel_sparse.triton_turboquant``:
  codes unpacked and looked up in registers, no dequantized copy of the history; any G; CUDA-graph
  safe) and in the plain-torch reference elsewhere (issue 17). The kernel is tested against the
  reference under the Triton interpreter and on the H200 (``benchmark/results/h200/gpu_tests_turboquant_kernel_*.txt``),
  and decodes inside SGLang's CUDA graphs there; it reads its codes at ~3.5% of HBM bandwidth (slower
  than dense's decode; docs/measured.md).

Counters (``/sparse/stats``): ``turboquant_blocks_written``, ``turboquant_store_full``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.turboquant_store import TurboQuantBlockStore
from sglang_sparse.methods.kivi import KIVIRuntime, check_fp_fraction
from sglang_sparse.registry import ConfigError, check_range, register_method

TURBOQUANT_BITS = (2, 3, 4)


@dataclass(frozen=True)
class TurboQuantConfig:
    bits: int = 3
    group: int = 32
    residual: int = 32
    fp_fraction: float = 0.25
    seed: int = 0

    def validate(self) -> None:
        if self.bits not in TURBOQUANT_BITS:
            raise ConfigError(f"bits={self.bits} is not supported: must be 2, 3 or 4")
        check_range("group", self.group, 1, 1024)
        check_range("residual", self.residual, 1)
        check_range("seed", self.seed, 0)
        check_fp_fraction(self.fp_fraction)


@register_method("turboquant", "quantization", TurboQuantConfig,
                 "seeded rotation + b-bit Lloyd-Max codes per coordinate (2/3/4 bits) + fp residual")
class TurboQuantRuntime(KIVIRuntime):
    store_cls = TurboQuantBlockStore
    blocks_key = "turboquant_blocks"

    def __init__(self, cache, config: TurboQuantConfig | None = None) -> None:
        super().__init__(cache, config or TurboQuantConfig())

    def check_layout(self, k0: torch.Tensor) -> None:
        if (k0.shape[-1] * self.config.bits) % 8:
            raise ConfigError(f"bits={self.config.bits} x head_dim {k0.shape[-1]} is not a whole number of bytes")

    def make_store(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, device):
        c = self.config
        return TurboQuantBlockStore(num_layers, kv_heads, head_dim, num_blocks, c.bits, c.group, c.seed, device)
