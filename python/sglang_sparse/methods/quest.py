"""Quest (Tang et al., ICML 2024): query-aware page selection; the full KV stays resident.

Per page of ``page_size`` tokens and KV head, the channel-wise min and max of the keys are kept
current as tokens arrive (prefill chunks and decode; a partial last page covers only its valid
tokens). At each decode step and layer, each query head scores every page by the upper bound
``sum_c max(q_c * max_c, q_c * min_c)`` and reads only its top ``min(max(3, token_budget //
page_size), n_pages)`` pages. The first ``dense_layers`` layers and all of prefill stay dense.

``select_per`` (``--sparse-select-per``): ``head`` (the default, the paper's rule) picks pages per
query head; ``kv_head`` picks one page set per KV head from the sum of its query heads' bounds,
and every query head of the group reads that set. The paper's models are multi-head (one query
head per KV head), where the two are the same; with grouped-query attention ``kv_head`` reads up
to 4x fewer distinct pages (8B shape, 4 query heads per KV head; per-head sets may overlap) for
the same per-head budget, each once per group (``triton_paged_gqa``), at the cost of one shared
choice per group. An adaptation, like SnapKV's usual GQA averaging.

Summaries live per *physical* page of the KV pool (``kernels.quest_pages``), so the engine
allocates KV in pages of ``page_size`` (the launcher sets SGLang's ``--page-size``): memory is
1/``page_size`` of the keys, a radix-cached prefix brings its summaries along, and decode
selection is a few tensor ops over persistent buffers that CUDA graphs capture
(``graph_decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo, StepMode
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.core.views import PagedDecodeView
from sglang_sparse.kernels import quest_pages
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class QuestConfig:
    page_size: int = 16
    token_budget: int = 1024
    dense_layers: int = 2
    select_per: str = "head"

    def validate(self) -> None:
        check_range("page_size", self.page_size, 1, 4096)
        check_range("token_budget", self.token_budget, self.page_size)
        check_range("dense_layers", self.dense_layers, 0)
        if self.select_per not in ("head", "kv_head"):
            raise ConfigError(f"select_per={self.select_per!r} is not allowed: must be head (top pages per query "
                              "head, the paper's rule) or kv_head (one page set per KV head from the sum of its "
                              "query heads' bounds)")

    @property
    def pages_per_head(self) -> int:
        return max(3, self.token_budget // self.page_size)


@register_method("quest", "dynamic selection", QuestConfig, "query-aware top pages per decode step")
class QuestRuntime(SparseMethodRuntime):
    graph_decode = True

    def __init__(self, cache, config: QuestConfig | None = None) -> None:
        super().__init__(cache)
        self.config = config or QuestConfig()
        self.summaries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sparse layer -> kmin, kmax
        self.q_heads: int | None = None  # learnt at the first decode layer

    @staticmethod
    def required_page_size(config: QuestConfig) -> int:
        return config.page_size

    def _sparse(self, layer_id: int) -> bool:
        return layer_id >= self.config.dense_layers

    def _pages(self, layer_id: int, k_cache: torch.Tensor):
        """Summaries of one layer, allocated on first use (before any graph capture: SGLang runs
        eager warm-up forwards first)."""
        if layer_id not in self.summaries:
            self.summaries[layer_id] = quest_pages.new_summaries(
                k_cache.shape[0], self.config.page_size, k_cache.shape[1], k_cache.shape[2],
                k_cache.dtype, k_cache.device)
        return self.summaries[layer_id]

    # -- prefill and mixed steps (eager) ---------------------------------------------------------
    def before_attention(self, layer: LayerInput) -> None:
        """Fold this step's keys into their pages (Quest never evicts: row == position)."""
        if layer.step.mode is StepMode.DECODE or not self._sparse(layer.layer_id):
            return
        store = self.cache.store
        slots = torch.cat([store.row_slots(r.req_row, r.row_start, r.row_start + r.num_tokens)
                           for r in layer.step.requests]).to(layer.k.device)
        kmin, kmax = self._pages(layer.layer_id, store.k_buffer(layer.layer_id))
        quest_pages.add_keys(kmin, kmax, layer.k, slots, self.config.page_size)

    # -- decode steps (tensor-only; captured into CUDA graphs) -----------------------------------
    def decode_view_tensors(self, batch: DecodeBatch) -> PagedDecodeView | None:
        if not self._sparse(batch.layer_id):
            return None
        ps = self.config.page_size
        self.q_heads = batch.q.shape[1]
        kmin, kmax = self._pages(batch.layer_id, batch.k_cache)
        quest_pages.add_decode_keys(kmin, kmax, batch.k, batch.slots, ps)
        scores = quest_pages.page_scores(batch.q, kmin, kmax, batch.table, batch.req_rows, batch.n_rows, ps)
        per_kv_head = self.config.select_per == "kv_head"
        if per_kv_head:  # [B, H_q, P] -> [B, H_kv, P]: one choice per group, read by all its query heads
            scores = quest_pages.group_scores(scores, batch.q.shape[1] // kmin.shape[1])
        # aligned: SGLang runs with --page-size page_size (required_page_size), so row-page p is
        # one whole pool page (the summaries rely on this too)
        return PagedDecodeView(quest_pages.top_pages(scores, self.config.pages_per_head), ps, batch.n_rows,
                               aligned=True, per_kv_head=per_kv_head)

    def finish_step(self, step: StepInfo) -> None:
        """Count pages read and available per query head, host-side (a replayed graph cannot):
        ``pages_selected`` / ``pages_total`` summed over sparse layers and query heads."""
        if step.mode is not StepMode.DECODE or self.q_heads is None:
            return
        layers = max(0, self.cache.store.num_layers - self.config.dense_layers)
        for r in step.requests:
            n = -(-r.logical_end // self.config.page_size)
            self.bump("pages_selected", layers * self.q_heads * min(n, self.config.pages_per_head))
            self.bump("pages_total", layers * self.q_heads * n)
