"""Factories of the two attention backends SGLang builds under its own names when an
sglang_sparse server runs (``inventory``: ``attention-backend:*``). Each builds the backend and
then this scheduler's SparseController (the KV pool exists by then)."""

from __future__ import annotations

from sglang_sparse.srt.engine import controller


def create_torch_native(model_runner):
    """``torch_native``: the CPU path."""
    from sglang_sparse.srt.engine.attention import SparseTorchNativeBackend

    backend = SparseTorchNativeBackend(model_runner)
    controller.ensure_controller(model_runner)
    return backend


def create_triton(model_runner):
    """``triton``: the CUDA path (imports SGLang's Triton backend, so only when built)."""
    from sglang_sparse.srt.engine.attention_triton import SparseTritonBackend

    backend = SparseTritonBackend(model_runner)
    controller.ensure_controller(model_runner)
    return backend
