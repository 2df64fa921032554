"""The CUDA path: SGLang's Triton attention backend with the sparse per-layer hooks.

Dense attention (prefill, and decode without a view) is SGLang's own Triton kernels over the
resident rows (SGLang's ``seq_lens`` count rows, see ``engine/rows.py``); decode over a
DecodeView is sgl-kernel-sparse's kernel (``kernels.decode``). Imported only when SGLang builds
a ``triton`` backend, so the CPU path never loads it.
"""

from __future__ import annotations

import torch
from sgl_kernel_sparse import tuning as kernel_tuning
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_sparse.srt.engine.attention import SparseHooks


class SparseTritonBackend(SparseHooks, TritonAttnBackend):
    def __init__(self, model_runner, *args, **kwargs):
        super().__init__(model_runner, *args, **kwargs)
        # the kernels' per-GPU launch table (sgl_kernel_sparse/tuning.py), read now: never for the
        # first time inside a decode forward that torch.compile traces or a CUDA graph captures
        kernel_tuning.preload(torch.device(model_runner.device, model_runner.gpu_id))

    def _write_kv(self, k, v, layer, forward_batch) -> None:
        loc = KVWriteLoc.for_batch(forward_batch, swa_loc=self.forward_metadata.swa_out_cache_loc)
        self._set_kv_buffer(forward_batch, layer, loc, k, v, layer.k_scale, layer.v_scale)
