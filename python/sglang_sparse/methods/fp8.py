"""FP8 KV: every token's K and V stored as fp8 e4m3 (1 byte per element), full attention.

Through SGLang's own fp8 KV cache (``--kv-cache-dtype fp8_e4m3``, which the launcher adds): the
pool SGLang allocates and sizes is the fp8 store, so a pool of N slots takes half the bytes of
bf16 / fp16 (``/sparse/stats`` ``kv_bytes_per_token``) and the same bytes hold twice the tokens.
Writes divide by the layer's scale and cast (values past +-448 x scale saturate); reads cast
back (and multiply by the scale on the Triton backend).

Scales: per tensor (one K and one V scale per layer), the checkpoint's ``kv_cache_scales`` as
SGLang loads them, 1.0 when the checkpoint has none (the default model: its post-RoPE keys and
values stay far inside e4m3's range). Per-head scales exist in the kernel package
(``sgl_kernel_sparse.quant.fp8_scales``, ``triton_fp8``) but are not wired here: SGLang's
torch_native path reads fp8 without a scale, so a scale other than 1.0 would be wrong on the CPU.

Everything else is dense: radix prefix caching, Chain Cache (pinned paths) and ``/prune`` work
on the fp8 pool as they do on the model-precision one (``/prune`` moves bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.registry import register_method

FP8_KV_DTYPE = "fp8_e4m3"


@dataclass(frozen=True)
class FP8Config:
    def validate(self) -> None:
        pass


@register_method("fp8", "quantization", FP8Config, "fp8 e4m3 KV payload (SGLang's fp8 KV cache), full attention")
class FP8Runtime(SparseMethodRuntime):
    changes_attention = False

    def __init__(self, cache, config: FP8Config | None = None) -> None:
        super().__init__(cache)
        self.config = config or FP8Config()

    @staticmethod
    def required_kv_cache_dtype(config) -> str:
        return FP8_KV_DTYPE
