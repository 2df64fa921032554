"""``KVStore`` over SGLang's KV pool, ``req_to_token`` table and allocator."""

from __future__ import annotations

import torch
from sgl_kernel_sparse import compact_kv

from sglang_sparse.srt.state import STATE


class SGLangKVStore:
    def __init__(self, model_runner) -> None:
        self.pool = model_runner.token_to_kv_pool
        self.req_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.num_layers = model_runner.model_config.num_hidden_layers

    def k_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.get_key_buffer(layer)

    def v_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.get_value_buffer(layer)

    def row_slots(self, req_row: int, start: int, end: int) -> torch.Tensor:
        return self.req_to_token[req_row, start:end].to(torch.int64)

    def rows_slots(self, req_rows: torch.Tensor, n: int) -> torch.Tensor:
        return self.req_to_token[req_rows.to(self.req_to_token.device), :n].to(torch.int64)

    def free_slots(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def free_count(self) -> int:
        return self.allocator.available_size()

    def move_kv(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Compaction's moves: one sgl-kernel-sparse ``compact_kv`` (Triton on CUDA)."""
        compact_kv(self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer), src, dst)

    def bytes_per_slot(self) -> int:
        """Bytes one slot (one token's K and V in every layer) takes in the pool."""
        return sum(self.k_buffer(layer)[0].nbytes + self.v_buffer(layer)[0].nbytes
                   for layer in range(self.num_layers))

    def truncate_rows(self, req_row: int, n_rows: int) -> None:
        """Nothing to do on the table: rows ``[0, n_rows)`` keep their slots. SGLang's per-request
        lengths are patched by ``step_hooks.before_prepare_for_decode`` right after."""

    def set_row_slots(self, req_row: int, slots: torch.Tensor) -> None:
        """SGLang's ``req_to_token`` row: its first ``len(slots)`` entries (the decode kernels and
        CUDA graphs read the table, so nothing else changes)."""
        self.req_to_token[req_row, : len(slots)] = slots.to(self.req_to_token.device, self.req_to_token.dtype)

    def flat_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's K and V as ``[layers * slots, H, D]`` (``engine/flat_pool.py``)."""
        flat = STATE.scheduler.flat_kv
        if flat is None:
            raise RuntimeError("this KV pool was not allocated as one tensor (engine/flat_pool.py)")
        return flat[0].view(-1, *flat.shape[3:]), flat[1].view(-1, *flat.shape[3:])

    def cells(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return layer * STATE.scheduler.flat_kv.shape[2] + slots.to(torch.int64)

    def table_shape(self) -> tuple[int, int]:
        return tuple(self.req_to_token.shape)

    def payload_budget_bytes(self) -> int | None:
        """Bytes of the pool left to the method's own store (engine/payload_pool.py)."""
        return STATE.scheduler.payload_budget_bytes
