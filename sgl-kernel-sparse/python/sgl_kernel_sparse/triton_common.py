"""Small helpers shared by the Triton wrappers."""

from __future__ import annotations

import os

import torch
import triton


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
