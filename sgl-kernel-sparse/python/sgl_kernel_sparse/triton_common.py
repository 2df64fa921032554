"""Small helpers shared by the Triton wrappers."""

from __future__ import annotations

import os

import torch
import triton

LOG2E = 1.4426950408889634  # log2(e): softmax scale * LOG2E gives base-2 logits (kernels use exp2)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read by
    ``triton.jit`` when a kernel module is imported, so it must be set before that import)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def check_device(*tensors: torch.Tensor) -> None:
    """Kernels need CUDA tensors (or CPU tensors under the interpreter)."""
    for t in tensors:
        if not (t.is_cuda or interpreting()):
            raise ValueError("Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU)")


def check_rows(*tensors: torch.Tensor) -> None:
    """Data tensors (q, caches, summaries) are read as contiguous rows of D elements."""
    check_device(*tensors)
    for t in tensors:
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"innermost dim must be contiguous, got strides {t.stride()}")


FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))  # the fnuz pair: SGLang's fp8 on ROCm


def kernel_keys(q: torch.Tensor, keys: torch.Tensor, q_name: str, k_name: str = "keys", slots=None):
    """The keys (and ``slots``) a score kernel reads: ``keys`` of q's dtype, or fp8 (SGLang's
    ``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2`` pool) next to 16/32-bit queries, which the kernels
    convert tile by tile as they load them (exact: every fp8 value is a bf16 / fp16 value), so the
    pool is never copied. Triton converts fp8 in a kernel from sm_89 on; on older GPUs the keys
    (gathered through ``slots`` first, if given) are converted in torch here. Any other pair of
    dtypes is refused. No fp8 scale is applied: SGLang's pools hold ``k / k_scale``, and
    ``k_scale`` is 1 unless the checkpoint carries KV scales."""
    if keys.dtype != q.dtype and not (keys.dtype in FP8_DTYPES and q.dtype in _FP8_QUERY_DTYPES):
        raise ValueError(f"{q_name} {q.dtype} and {k_name} {keys.dtype} must share a dtype "
                         f"(or {k_name} be fp8 next to fp16 / bf16 / fp32 {q_name})")
    if keys.dtype != q.dtype and not fp8_in_kernel(keys.device):
        if slots is not None:
            keys, slots = keys[slots.long()], None
        keys = keys.to(q.dtype)
    return keys, slots


_FP8_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_OK: dict = {}  # device index -> compute capability >= 8.9, read once


def fp8_in_kernel(device: torch.device) -> bool:
    """Whether Triton can convert fp8 inside a kernel here: the interpreter, or sm_89+ GPUs."""
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FP8_OK:
        _FP8_OK[index] = torch.cuda.get_device_capability(index) >= (8, 9)
    return _FP8_OK[index]


def check_gqa(hq: int, hkv: int) -> None:
    """Grouped-query attention: query head ``h`` reads KV head ``h // (hq // hkv)``."""
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")


def check_table(req_to_token: torch.Tensor) -> None:
    """The kernels index a slot-table row as ``row * stride(0) + position``."""
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")


def pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(max(1, int(n))))


_SMS: dict = {}  # device index -> SM count, read once (no device query inside a traced forward)


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter: few programs keep it fast
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
