"""PyramidKV (Cai et al., 2024): SnapKV's scores, per-layer budgets shaped as a pyramid.

Lower layers attend broadly and keep more, upper layers keep less: with an average budget C per
layer (window w included) layer l keeps ``pyramid_budgets(...)[l] + w`` positions per KV head
(``sgl_kernel_sparse.reference.pyramid_budgets``, beta = 20: layer 0 about 2 (C - w), the last
layer (C - w) / beta), chosen by SnapKV's observation-window scores of that layer (fp32,
GQA-averaged, pooled, ties to the lower position) plus the window. Prompts of at most C tokens
are not compressed; prompts shorter than 2 (C - w) get SnapKV's uniform budget.

Memory: the compaction frees each layer's own dropped rows (``CacheManager.compact_layers``):
the kept entries of all layers are packed into ``ceil(sum_l B_l / layers)`` slots of the pool
(``kv_store`` flat cells, docs/kv_payload.md), so PyramidKV at average budget C holds about the
slots SnapKV at C holds. Attention then reads each layer's own rows. Decode is tensor-only
(``graph_decode``, inside SGLang's decode CUDA graphs): device tables mirror each request's
per-layer map (``core/cell_tables``, updated at safe points) and the kernel
(``sgl_kernel_sparse.cells_decode_attention``) finds every row's cell from them and the slot
table, so nothing is built per step. A prefill chunk after per-layer rows (a resumed chain)
reads them through ``LayerRowsView`` (eager, plain torch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse.reference import PYRAMIDKV_BETA, SNAPKV_KERNEL, SNAPKV_WINDOW, pyramid_budgets

from sglang_sparse.core.events import DecodeBatch
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.views import CellsDecodeView
from sglang_sparse.kernels import snapkv_keep_indices
from sglang_sparse.methods.snapkv import SnapKVConfig, SnapKVRuntime
from sglang_sparse.registry import check_range, register_method


@dataclass(frozen=True)
class PyramidKVConfig:
    budget: int = 1024
    window: int = SNAPKV_WINDOW
    kernel: int = SNAPKV_KERNEL
    beta: int = PYRAMIDKV_BETA

    def validate(self) -> None:
        SnapKVConfig(self.budget, self.window, self.kernel).validate()
        check_range("beta", self.beta, 1)


@dataclass(frozen=True)
class PyramidOracle(MemoryOracle):
    """Engine rows after compaction: the slots the packed per-layer budgets need."""

    config: PyramidKVConfig | None = None
    num_layers: int = 1

    def rows_after_prefill(self, prompt_len: int) -> int:
        if prompt_len <= self.config.budget:
            return prompt_len
        return -(-sum(layer_budgets(self.config, prompt_len, self.num_layers)) // self.num_layers)


def layer_budgets(config: PyramidKVConfig, prompt_rows: int, num_layers: int) -> list[int]:
    """Positions kept per layer, the window included."""
    w = min(config.window, config.budget)
    return [b + w for b in pyramid_budgets(prompt_rows, config.budget, w, num_layers, config.beta)]


@register_method("pyramidkv", "eviction", PyramidKVConfig, "SnapKV scores with pyramid per-layer budgets")
class PyramidKVRuntime(SnapKVRuntime):
    per_layer_rows = True
    graph_decode = True

    def __init__(self, cache, config: PyramidKVConfig | None = None) -> None:
        super().__init__(cache, config or PyramidKVConfig())
        self.oracle = PyramidOracle(retained_budget=self.config.budget, config=self.config,
                                    num_layers=cache.store.num_layers)
        self.tables = cache.enable_cell_tables()

    def decode_view_tensors(self, batch: DecodeBatch) -> CellsDecodeView:
        return CellsDecodeView(self.tables, batch.layer_id)

    def plan(self, rid: str) -> list[torch.Tensor]:
        state = self.cache.requests[rid]
        prompt, ret = state.prompt_len, state.retained
        window_q = state.metadata.pop("window_q")
        flat_k, _ = self.cache.store.flat_kv()
        keep = []
        for layer in range(self.cache.store.num_layers):
            held = ret.layer_positions(layer)  # [kv_heads, rows of this layer]
            prompt_rows = int((held[0] < prompt).sum())  # a resumed chain holds fewer than the prompt
            budget = layer_budgets(self.config, prompt_rows, self.cache.store.num_layers)[layer]
            cells = self.cache.layer_cells(rid, layer)[:prompt_rows]  # the prompt's keys, in place
            picked = snapkv_keep_indices(window_q[layer], flat_k, budget, self.config.window,
                                         self.config.kernel, slots=cells.to(flat_k.device))
            kept = held[:, :prompt_rows].gather(1, picked.cpu())
            tail = held[:, prompt_rows:]  # tokens decoded before the safe point: kept
            keep.append(torch.cat([kept, tail], dim=1))
        return keep
