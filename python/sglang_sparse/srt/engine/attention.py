"""Attention backends that hand each layer to the SparseController.

``SparseHooks`` is the per-layer logic, mixed into two of SGLang's own backends and registered
under their names when an sglang_sparse server runs (so SGLang's rules for each name apply):

- ``torch_native`` (``SparseTorchNativeBackend``): the CPU path;
- ``triton`` (``SparseTritonBackend``, in ``engine/attention_triton.py``): the CUDA path.

Per layer: write this step's KV, ask the controller for the view, run attention over it (no view:
the backend's own dense kernel over the resident rows; a DecodeView: ``kernels.decode``, i.e.
sgl-kernel-sparse's Triton kernel on CUDA, the plain-torch reference elsewhere), then report the
output. Decode steps take one of three paths, chosen by the method's capabilities:
- ``graph_decode`` (Quest, OmniKV, PyramidKV, KIVI, H2O, R-KV): tensor-only ``decode_view_tensors``
  and the kernel of the view it returns (paged, rows + tail, per-layer cells, quantized blocks; no
  view: the backend's own kernel), also inside SGLang's captured decode CUDA graphs;
- per-layer Python hooks (``decode_hooks``): eager only (the launcher disables CUDA graphs); the
  view is a ``DecodeView`` (rows for ``kernels.decode``) or a ``ComputedDecodeView`` (the method
  computes the layer's output itself, RetroInfer);
- neither (dense, SnapKV): the backend's own path untouched, CUDA graphs included.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_sparse.core.events import DecodeBatch, LayerInput
from sglang_sparse.core.views import (BlockSparsePrefillView, CellsDecodeView, ComputedDecodeView, DecodeView,
                                      LayerRowsView, PrefixKVView, QuantizedDecodeView, RowsTailDecodeView)
from sglang_sparse.kernels.decode import decode_over_cells, decode_over_pages, decode_over_rows_tail, decode_over_views
from sglang_sparse.kernels.prefill import extend_over_cells, extend_over_kv
from sglang_sparse.kernels.quantized import quantized_decode
from sglang_sparse.srt.prune import scheduler as prune
from sglang_sparse.srt.state import STATE


class SparseHooks:
    """Mixed in before an SGLang attention backend class; ``_write_kv`` is backend-specific."""

    def _write_kv(self, k, v, layer, forward_batch) -> None:
        raise NotImplementedError

    def _layer_input(self, q, k, v, layer) -> LayerInput:
        d = layer.qk_head_dim
        return LayerInput(
            layer.layer_id,
            STATE.scheduler.current_step,
            q.reshape(-1, layer.tp_q_head_num, d),
            k.reshape(-1, layer.tp_k_head_num, d),
            v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim),
        )

    @staticmethod
    def _plain(k, layer, save_kv_cache, extra: dict) -> bool:
        """Plain self-attention writing new KV; anything else (sinks, score mods, cross
        attention, a read-back without new KV) is left to the backend untouched."""
        return (all(v is None for v in extra.values()) and save_kv_cache and k is not None
                and not layer.is_cross_attention)

    def _hooked(self, k, layer, save_kv_cache, extra: dict) -> bool:
        """A running method's step with per-layer Python hooks."""
        return (
            STATE.scheduler.controller is not None
            and STATE.scheduler.controller.layer_hooks
            and STATE.scheduler.current_step is not None
            and self._plain(k, layer, save_kv_cache, extra)
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not self._hooked(k, layer, save_kv_cache, kwargs):
            o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        else:
            self._write_kv(k, v, layer, forward_batch)
            inp = self._layer_input(q, k, v, layer)
            view = STATE.scheduler.controller.attention_view(inp)
            if isinstance(view, BlockSparsePrefillView) and all(view.sparse):  # no request left dense
                o = q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
            else:
                o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=False)
            if isinstance(view, BlockSparsePrefillView):  # sparse prefill: the marked requests' chunks
                self._extend_block_sparse(inp, view, layer, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
            elif isinstance(view, LayerRowsView):  # earlier rows in per-layer cells: recompute those
                self._extend_over_cells(inp, view, layer, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
            elif isinstance(view, PrefixKVView):  # history in a method store: recompute those
                self._extend_over_prefix(inp, view, layer, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
            STATE.scheduler.controller.attention_done(inp, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
        if STATE.scheduler.probe_rows and self._plain(k, layer, save_kv_cache, kwargs):
            prune.capture(self, q, layer, forward_batch)  # a /prune probe scores its interval
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        ctl = STATE.scheduler.controller
        if ctl is not None and ctl.graph_decode and self._plain(k, layer, save_kv_cache, kwargs):
            # Also runs while SGLang captures a decode CUDA graph (no current step then).
            return self._graph_safe_decode(q, k, v, layer, forward_batch)
        if not (self._hooked(k, layer, save_kv_cache, kwargs) and ctl.decode_hooks):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        self._write_kv(k, v, layer, forward_batch)
        inp = self._layer_input(q, k, v, layer)
        view = STATE.scheduler.controller.attention_view(inp)
        if view is None:
            o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=False)
        elif isinstance(view, ComputedDecodeView):  # the method's own output (RetroInfer's tiers)
            o = view.attend(layer.scaling).to(q.dtype).reshape(inp.q.shape[0], -1)
        else:
            o = self._decode_over_view(inp, view, layer, forward_batch)
        STATE.scheduler.controller.attention_done(inp, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
        return o

    def _graph_safe_decode(self, q, k, v, layer, forward_batch):
        """Tensor-only decode (``graph_decode`` methods): write KV, let the method update its
        persistent state and name the pages to read, run the paged kernel. No host sync."""
        self._write_kv(k, v, layer, forward_batch)
        d = layer.qk_head_dim
        q3 = q.reshape(-1, layer.tp_q_head_num, d)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        table = self.req_to_token_pool.req_to_token
        batch = DecodeBatch(layer.layer_id, q3, k.reshape(-1, layer.tp_k_head_num, d),
                            forward_batch.req_pool_indices, forward_batch.seq_lens,
                            forward_batch.out_cache_loc, table, k_cache, v_cache)
        view = STATE.scheduler.controller.decode_view_tensors(batch)
        if view is None:
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=False)
        if isinstance(view, CellsDecodeView):
            flat_k, flat_v = self._flat_kv()
            out = decode_over_cells(q3, flat_k, flat_v, table, batch.req_rows, batch.n_rows, view.tables,
                                    view.layer, layer.scaling)
        elif isinstance(view, QuantizedDecodeView):
            # history blocks of each request + its resident full-precision rows (this token's incl.)
            out = quantized_decode(q3, view.store, layer.layer_id, view.block_table, batch.req_rows.long(),
                              view.n_blocks, k_cache, v_cache, table, batch.n_rows, layer.scaling)
        elif isinstance(view, RowsTailDecodeView):  # chosen rows + the contiguous tail (OmniKV)
            out = decode_over_rows_tail(q3, k_cache, v_cache, table, batch.req_rows, view.sel_rows,
                                        view.tail_start, view.n_rows, layer.scaling)
        else:
            out = decode_over_pages(q3, k_cache, v_cache, table, batch.req_rows, view.page_ids, view.n_rows,
                                    view.page_size, layer.scaling, aligned=view.aligned,
                                    per_kv_head=view.per_kv_head)
        return out.view(q3.shape[0], -1)

    @staticmethod
    def _flat_kv():
        return STATE.scheduler.controller.cache.store.flat_kv()

    def _extend_over_cells(self, inp: LayerInput, view: LayerRowsView, layer, out) -> None:
        flat_k, flat_v = self._flat_kv()
        for i, cells in enumerate(view.cells):
            if cells is None:
                continue
            start = inp.step.token_offsets[i]
            n = inp.step.requests[i].num_tokens
            out[start: start + n] = extend_over_cells(
                inp.request_tokens(i, inp.q), inp.request_tokens(i, inp.k), inp.request_tokens(i, inp.v),
                flat_k, flat_v, cells, layer.scaling)

    def _resident_kv(self, layer, r) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of request ``r``'s resident rows ``[0, row_start)`` in this layer, in row order
        (the rows before its chunk, read through the engine's slot table)."""
        slots = self.req_to_token_pool.req_to_token[r.req_row, : r.row_start].long()
        return (self.token_to_kv_pool.get_key_buffer(layer.layer_id)[slots],
                self.token_to_kv_pool.get_value_buffer(layer.layer_id)[slots])

    def _extend_over_prefix(self, inp: LayerInput, view: PrefixKVView, layer, out) -> None:
        for i, prefix in enumerate(view.prefix):
            if prefix is None:
                continue
            r = inp.step.requests[i]
            # history = the method's prefix (logical [0, n)), then resident rows [0, row_start)
            k_rows, v_rows = self._resident_kv(layer, r)
            k_prev = torch.cat([prefix[0].to(k_rows.dtype), k_rows])
            v_prev = torch.cat([prefix[1].to(v_rows.dtype), v_rows])
            start = inp.step.token_offsets[i]
            out[start: start + r.num_tokens] = extend_over_kv(
                inp.request_tokens(i, inp.q), inp.request_tokens(i, inp.k), inp.request_tokens(i, inp.v),
                k_prev, v_prev, layer.scaling)

    def _extend_block_sparse(self, inp: LayerInput, view: BlockSparsePrefillView, layer, out) -> None:
        for i, sparse in enumerate(view.sparse):
            if not sparse:
                continue
            r = inp.step.requests[i]
            # rows [0, row_start) are logical positions [0, row_start) (the controller checked);
            # the chunk is positions [row_start, row_start + s): keys in position order
            k_rows, v_rows = self._resident_kv(layer, r)
            k_all = torch.cat([k_rows, inp.request_tokens(i, inp.k).to(k_rows.dtype)])
            v_all = torch.cat([v_rows, inp.request_tokens(i, inp.v).to(v_rows.dtype)])
            q_i = inp.request_tokens(i, inp.q)
            start = inp.step.token_offsets[i]
            out[start: start + r.num_tokens] = view.attend(q_i, k_all.to(q_i.dtype), v_all.to(q_i.dtype), r.row_start,
                                                           layer.scaling).to(out.dtype)

    def _decode_over_view(self, inp: LayerInput, view: DecodeView, layer, forward_batch):
        reqs = inp.step.requests
        out = decode_over_views(
            inp.q,
            self.token_to_kv_pool.get_key_buffer(layer.layer_id),
            self.token_to_kv_pool.get_value_buffer(layer.layer_id),
            self.req_to_token_pool.req_to_token,
            [r.req_row for r in reqs],
            view.rows,
            view.valid,
            [r.row_start + r.num_tokens for r in reqs],  # resident rows incl. this token
            layer.scaling,
        )
        return out.view(inp.q.shape[0], -1)


class SparseTorchNativeBackend(SparseHooks, TorchNativeAttnBackend):
    def _write_kv(self, k, v, layer, forward_batch) -> None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
        )
