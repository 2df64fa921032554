"""The attention backend that hands each layer to the SparseController (CPU: torch_native).

Registered under SGLang's own name ``torch_native`` when an sglang_sparse server runs a method,
so SGLang's CPU default and its torch_native rules (CUDA graphs off) apply unchanged.
Per layer: write this step's KV, ask the controller for the view, run attention over it
(dense: SGLang's own SDPA path; a DecodeView: gathered rows), then report the output.
"""

from __future__ import annotations

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_sparse.core.events import LayerInput
from sglang_sparse.core.views import DecodeView
from sglang_sparse.kernels.decode import decode_over_views
from sglang_sparse.srt import state


class SparseTorchNativeBackend(TorchNativeAttnBackend):
    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        if state.pos_offset is not None and forward_batch.forward_mode.is_decode():
            # Logical RoPE positions for rows whose earlier KV was evicted (see state.pos_offset).
            forward_batch.positions = forward_batch.positions + state.pos_offset[
                forward_batch.req_pool_indices
            ].to(forward_batch.positions.dtype)

    def _write_kv(self, k, v, layer, forward_batch) -> None:
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v
        )

    def _layer_input(self, q, k, v, layer) -> LayerInput:
        d = layer.qk_head_dim
        return LayerInput(
            layer.layer_id,
            state.current_step,
            q.reshape(-1, layer.tp_q_head_num, d),
            k.reshape(-1, layer.tp_k_head_num, d),
            v.reshape(-1, layer.tp_k_head_num, layer.v_head_dim),
        )

    def _hooked(self, k, layer, save_kv_cache) -> bool:
        return (
            state.controller is not None
            and state.controller.layer_hooks
            and state.current_step is not None
            and save_kv_cache
            and k is not None
            and not layer.is_cross_attention
        )

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not self._hooked(k, layer, save_kv_cache):
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        self._write_kv(k, v, layer, forward_batch)
        inp = self._layer_input(q, k, v, layer)
        state.controller.attention_view(inp)  # prefill stays dense (no sparse-prefill method yet)
        o = super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=False)
        state.controller.attention_done(inp, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not self._hooked(k, layer, save_kv_cache):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        self._write_kv(k, v, layer, forward_batch)
        inp = self._layer_input(q, k, v, layer)
        view = state.controller.attention_view(inp)
        if view is None:
            o = super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache=False)
        else:
            o = self._decode_over_view(inp, view, layer, forward_batch)
        state.controller.attention_done(inp, o.view(-1, layer.tp_q_head_num, layer.v_head_dim))
        return o

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


def create_backend(model_runner):
    from sglang_sparse.srt import controller_setup

    backend = SparseTorchNativeBackend(model_runner)
    controller_setup.ensure_controller(model_runner)
    return backend
