"""A toy engine that drives the lifecycle contract like SGLang does (allocate rows, begin_step,
write KV, per-layer hooks, end_step, safe point), over ``TensorKVStore``: shared by the core
tests of every method."""

from __future__ import annotations

import torch

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.events import DecodeBatch, LayerInput, RequestSlice, StepInfo, StepMode
from sglang_sparse.core.kv_store import TensorKVStore
from sglang_sparse.registry import build_config, get_method


LAYERS, HQ, HKV, D = 3, 4, 2, 8


class ToyEngine:
    """Feeds given per-layer q/k/v through the contract like an engine would: allocate rows,
    begin_step, write KV, per-layer attention_view / attention_done, end_step, safe_point."""

    def __init__(self, method: str, knobs: dict | None = None, slots: int = 512, page_size: int = 1,
                 kv_heads: int = HKV, heads=None) -> None:
        """``kv_heads``, ``heads``: one tensor-parallel rank's share (``core.tensor_parallel``)."""
        self.store = TensorKVStore(LAYERS, slots, kv_heads, D, page_size=page_size)
        spec = get_method(method)
        runtime = spec.runtime_cls(CacheManager(self.store, kv_heads, heads), build_config(method, knobs))
        self.ctl = SparseController(runtime)
        self.views: list = []

    def run_step(self, mode, slices, q, k, v):
        """q/k/v: per layer ``[T, heads, d]`` for the step's tokens, in slice order."""
        for s in slices:
            self.store.alloc_rows(s.req_row, s.num_tokens)
        step = StepInfo(self.ctl.steps, mode, tuple(slices))
        self.ctl.begin_step(step)
        for layer in range(LAYERS):
            for i, s in enumerate(slices):
                off = step.token_offsets[i]
                rows = self.store.row_slots(s.req_row, s.row_start, s.row_start + s.num_tokens)
                self.store.write(layer, rows, k[layer][off : off + s.num_tokens], v[layer][off : off + s.num_tokens])
            if mode is StepMode.DECODE and self.ctl.graph_decode:  # the tensor-only decode hook
                self.views.append((layer, self.ctl.decode_view_tensors(self.decode_batch(layer, slices, q, k))))
                continue
            inp = LayerInput(layer, step, q[layer], k[layer], v[layer])
            self.views.append((layer, self.ctl.attention_view(inp)))
            self.ctl.attention_done(inp, torch.zeros_like(q[layer]))
        self.ctl.end_step(step)
        return self.ctl.safe_point()

    def decode_batch(self, layer, slices, q, k):
        rows = torch.tensor([s.req_row for s in slices])
        n_rows = torch.tensor([s.row_start + 1 for s in slices])
        slots = torch.cat([self.store.row_slots(s.req_row, s.row_start, s.row_start + 1) for s in slices])
        return DecodeBatch(layer, q[layer], k[layer], rows, n_rows, slots, self.store.table,
                           self.store.k[layer], self.store.v[layer])

    def prefill(self, rid, row, q, k, v, chunk, metadata=None):
        """Prefill one request's prompt in chunks of ``chunk`` tokens (``metadata``: the
        request's starting method metadata, as an engine passes it)."""
        length = q[0].shape[0]
        self.ctl.request_started(rid, row, length, metadata=metadata)
        freed = 0
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            rows0 = self.ctl.cache.retained(rid).n_rows
            s = RequestSlice(rid, row, start, end, rows0, length)
            freed += self.run_step(StepMode.PREFILL, [s], [x[start:end] for x in q],
                                   [x[start:end] for x in k], [x[start:end] for x in v])
        return freed

    def decode(self, rid, row, q, k, v):
        ret = self.ctl.cache.retained(rid)
        s = RequestSlice(rid, row, ret.logical_len, ret.logical_len + 1, ret.n_rows,
                         self.ctl.cache.requests[rid].prompt_len)
        return self.run_step(StepMode.DECODE, [s], q, k, v)

    def finish(self, rid, row):
        self.ctl.request_finished(rid)
        self.store.release_row(row)


def qkv(length, seed):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(length, h, D, generator=g) for _ in range(LAYERS)] for h in (HQ, HKV, HKV)]
