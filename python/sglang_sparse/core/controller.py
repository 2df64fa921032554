"""SparseController: the facade the engine adapter calls (engine-agnostic, no method names).

The adapter translates engine events into these calls; the controller keeps the cache manager's
row bookkeeping in step with the engine and forwards to the method's runtime hooks in the order
documented in ``runtime``.
"""

from __future__ import annotations

import torch

from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo, StepMode
from sglang_sparse.core.prefill import PrefillPolicy
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.core.views import BlockSparsePrefillView, DecodeView, LayerRowsView, PagedDecodeView, PrefixKVView


class SparseController:
    def __init__(self, runtime: SparseMethodRuntime, prefill: PrefillPolicy | None = None) -> None:
        self.runtime = runtime
        self.prefill = prefill  # a sparse prefill policy (--sparse-prefill), composed with the method
        self.cache = runtime.cache
        self.steps = 0
        self.peak_requests = 0  # most requests holding KV at one step since start (/sparse/stats)
        self.oracle = runtime.oracle
        # A runtime that overrides no per-layer hook (dense) lets the adapter skip the per-layer
        # calls entirely: default hooks are no-ops, so skipping them changes nothing.
        self.layer_hooks = type(runtime).has_layer_hooks() or prefill is not None
        # Decode steps: tensor-only hook (graph-safe), Python per-layer hooks, or nothing at all.
        self.graph_decode = runtime.graph_decode
        if runtime.per_layer_rows and not runtime.graph_decode:
            raise TypeError(f"{type(runtime).__name__}: per-layer rows decode through CellsDecodeView "
                            "(decode_view_tensors): set graph_decode = True")
        self.decode_hooks = type(runtime).decode_needs_python()
        # Only methods with a store of their own are asked for history outside the slot table
        # (prefill, every layer) and for admission (every waiting request): others skip both.
        self.prefix_hook = type(runtime).overrides("prefix_kv")
        self.store_admission = type(runtime).overrides("store_admits")

    # -- requests ----------------------------------------------------------------------------
    def request_started(self, rid: str, req_row: int, prompt_len: int, cached_len: int = 0,
                        cached_logical: int | None = None, metadata: dict | None = None) -> None:
        """``metadata``: method state of a cached prefix the request starts on (the radix
        cache's units, ``runtime.units_metadata``)."""
        self.cache.start(rid, req_row, prompt_len, cached_len, cached_logical, metadata)
        self.runtime.on_request_start(rid)

    def request_resumed(self, rid: str, req_row: int, prompt_len: int, retained, metadata: dict) -> None:
        """Chain Cache: the request continues from retained rows + method metadata."""
        self.cache.attach(rid, req_row, prompt_len, retained, metadata)
        self.runtime.on_request_start(rid)

    def request_finished(self, rid: str) -> None:
        if rid in self.cache.requests:
            self.runtime.on_request_end(rid)
            self.cache.release(rid)

    # -- one forward step --------------------------------------------------------------------
    def begin_step(self, step: StepInfo) -> None:
        """The engine allocated rows for this step's tokens and is about to run the model."""
        for r in step.requests:
            self.cache.on_written(r.rid, r.num_tokens)
        self.steps += 1
        self.peak_requests = max(self.peak_requests, len(self.cache.requests))
        self.runtime.prepare_step(step)

    def attention_view(self, layer: LayerInput) -> DecodeView | LayerRowsView | None:
        """Called by the attention backend in every layer, after this step's KV is written."""
        self.runtime.before_attention(layer)
        if any(r.is_prefill for r in layer.step.requests):
            self.runtime.on_prefill_chunk(layer)
        rows = self.layer_rows(layer)
        if rows is not None:
            return rows
        prefix = self.prefix_view(layer)
        if prefix is not None:
            return prefix
        if layer.step.mode is StepMode.DECODE:
            return self.runtime.build_decode_selection(layer)
        return self.prefill_view(layer)

    def prefill_view(self, layer: LayerInput) -> BlockSparsePrefillView | None:
        """Prefill and mixed steps with a sparse prefill policy: the requests it may serve are the
        prefilling ones whose rows are their logical positions (identity map, the chunk's first
        row = its first position); the policy decides the rest."""
        if self.prefill is None:
            return None
        reqs = self.cache.requests
        eligible = tuple(r.is_prefill and r.rid in reqs and reqs[r.rid].retained.is_identity
                         and r.row_start == r.logical_start for r in layer.step.requests)
        return self.prefill.view(layer, eligible) if any(eligible) else None

    def layer_rows(self, layer: LayerInput) -> LayerRowsView | None:
        """Prefill and mixed steps: where the requests' earlier rows of this layer live, when any
        request has a per-layer map (its rows are not the engine's slot table); None otherwise.
        (Decode steps of per-layer methods read ``CellsDecodeView``, never this.)"""
        reqs = self.cache.requests
        step = layer.step
        if step.mode is StepMode.DECODE or not any(
                r.rid in reqs and reqs[r.rid].retained.per_layer for r in step.requests):
            return None
        cells = []
        for r in step.requests:
            if not (r.rid in reqs and reqs[r.rid].retained.per_layer):
                cells.append(None)
                continue
            c = self.cache.layer_cells(r.rid, layer.layer_id)
            cells.append(c[: c.numel() - r.num_tokens])  # the rows before this chunk
        return LayerRowsView(tuple(cells))

    def prefix_view(self, layer: LayerInput) -> PrefixKVView | None:
        """Prefill and mixed steps: the history of prefilling requests held outside the slot
        table (``runtime.prefix_kv``), when any request has one; None otherwise."""
        if not self.prefix_hook or layer.step.mode is StepMode.DECODE:
            return None
        prefix = tuple(self.runtime.prefix_kv(r.rid, layer.layer_id) if r.is_prefill and r.rid in self.cache.requests
                       else None for r in layer.step.requests)
        return PrefixKVView(prefix) if any(p is not None for p in prefix) else None

    def decode_view_tensors(self, batch: DecodeBatch) -> PagedDecodeView | None:
        """Decode layers of ``graph_decode`` methods (also while a CUDA graph is captured). The
        counter grows only when Python runs: eager steps and capture, never a graph replay. While
        torch.compile traces the decode forward (``--enable-torch-compile``) it is not bumped: a
        traced read-modify-write of a Python int would be guarded on its value and recompiled at
        every call, also during the CUDA-graph capture."""
        if not torch.compiler.is_compiling():
            self.runtime.bump("decode_layer_python_calls")
        return self.runtime.decode_view_tensors(batch)

    def attention_done(self, layer: LayerInput, out: torch.Tensor) -> None:
        self.runtime.after_attention(layer, out)
        self.runtime.on_layer_end(layer.layer_id, layer.step)

    def end_step(self, step: StepInfo) -> None:
        self.runtime.finish_step(step)

    def safe_point(self, only: set[str] | None = None) -> int:
        """Between steps, when no forward reads the KV: apply planned compactions (for the
        requests in ``only``, None: all). Returns slots freed."""
        return self.runtime.apply_pending(only)

    # -- memory (the scheduler asks when it admits a request) ----------------------------------
    def decode_reserve(self, prompt_len: int, max_new_tokens: int) -> int:
        """Rows the scheduler should reserve for decoding beyond the prompt (see MemoryOracle)."""
        rows = self.oracle.decode_reserve(prompt_len, max_new_tokens)
        self.runtime.bump("admission_rows_saved", max_new_tokens - rows)
        return rows

    # -- observability -----------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "method": self.runtime.name,
            "steps": self.steps,
            "peak_running_requests": self.peak_requests,
            **self.cache.totals(),
            "counters": {**self.cache.counters, **self.runtime.counters,
                         **(self.prefill.counters if self.prefill is not None else {})},
            "timings_us": dict(self.runtime.timings_us),
        }
