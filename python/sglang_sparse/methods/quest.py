"""Quest (Tang et al., ICML 2024): query-aware page selection; the full KV stays resident.

Per page of ``page_size`` tokens and KV head, the channel-wise min and max of the keys are kept
current as tokens arrive (prefill chunks and decode; a partial last page covers only its valid
tokens). At each decode step and layer, each query head scores every page by the upper bound
``sum_c max(q_c * max_c, q_c * min_c)`` and reads only its top ``min(max(3, token_budget //
page_size), n_pages)`` pages (ties to the lower page). The first ``dense_layers`` layers and all
of prefill stay dense. ``page_size`` should equal the engine's page size so a page is one
allocation unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.events import LayerInput
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.core.views import DecodeView
from sglang_sparse.kernels import reference
from sglang_sparse.registry import check_range, register_method


@dataclass(frozen=True)
class QuestConfig:
    page_size: int = 16
    token_budget: int = 1024
    dense_layers: int = 2

    def validate(self) -> None:
        check_range("page_size", self.page_size, 1, 4096)
        check_range("token_budget", self.token_budget, self.page_size)
        check_range("dense_layers", self.dense_layers, 0)


class PageSummaries:
    """Min/max keys per page for one request and layer: ``[capacity_pages, H_kv, d]``."""

    def __init__(self, kv_heads: int, head_dim: int, page_size: int, device) -> None:
        self.page_size = page_size
        self.kmin = torch.full((4, kv_heads, head_dim), float("inf"), device=device)
        self.kmax = torch.full((4, kv_heads, head_dim), float("-inf"), device=device)
        self.n_tokens = 0

    def add(self, k: torch.Tensor) -> None:
        """Append keys of consecutive positions ``[n_tokens, n_tokens + len(k))``."""
        end = self.n_tokens + k.shape[0]
        pages = -(-end // self.page_size)
        if pages > self.kmin.shape[0]:
            grow = max(pages, 2 * self.kmin.shape[0]) - self.kmin.shape[0]
            self.kmin = torch.cat([self.kmin, self.kmin.new_full((grow, *self.kmin.shape[1:]), float("inf"))])
            self.kmax = torch.cat([self.kmax, self.kmax.new_full((grow, *self.kmax.shape[1:]), float("-inf"))])
        page_of = torch.arange(self.n_tokens, end, device=k.device) // self.page_size
        kf = k.float()
        idx = page_of.view(-1, 1, 1).expand_as(kf)
        self.kmin.scatter_reduce_(0, idx, kf, reduce="amin")
        self.kmax.scatter_reduce_(0, idx, kf, reduce="amax")
        self.n_tokens = end

    @property
    def n_pages(self) -> int:
        return -(-self.n_tokens // self.page_size)


@register_method("quest", "dynamic selection", QuestConfig, "query-aware top pages per decode step")
class QuestRuntime(SparseMethodRuntime):
    def __init__(self, cache, config: QuestConfig | None = None) -> None:
        super().__init__(cache)
        self.config = config or QuestConfig()

    def _summaries(self, rid: str, layer: int, k: torch.Tensor) -> PageSummaries:
        per_layer = self.cache.requests[rid].metadata.setdefault("pages", {})
        if layer not in per_layer:
            per_layer[layer] = PageSummaries(k.shape[1], k.shape[2], self.config.page_size, k.device)
        return per_layer[layer]

    def before_attention(self, layer: LayerInput) -> None:
        """Keep summaries current with this step's keys (Quest never evicts: row == position)."""
        for i, r in enumerate(layer.step.requests):
            k = layer.request_tokens(i, layer.k)
            pages = self._summaries(r.rid, layer.layer_id, k)
            if pages.n_tokens != r.logical_start:
                # A cached prefix: summarise the resident keys before this step's tokens.
                pages.add(self.cache.keys(r.rid, layer.layer_id)[pages.n_tokens : r.logical_start])
            pages.add(k)

    def build_decode_selection(self, layer: LayerInput) -> DecodeView | None:
        if layer.layer_id < self.config.dense_layers:
            return None
        ps = self.config.page_size
        rows, valid = [], []
        for i, r in enumerate(layer.step.requests):
            pages = self.cache.requests[r.rid].metadata["pages"][layer.layer_id]
            n = pages.n_pages
            q = layer.request_tokens(i, layer.q)[0]
            sel = reference.quest_select_pages(
                q, pages.kmin[:n], pages.kmax[:n], self.config.token_budget, ps
            )  # [H_q, n_sel]
            r_idx = (sel.unsqueeze(-1) * ps + torch.arange(ps, device=sel.device)).flatten(1)
            rows.append(r_idx)
            valid.append(r_idx < r.logical_end)  # last page may be partial
            self.bump("pages_selected", sel.numel())
            self.bump("pages_total", n * sel.shape[0])
        return DecodeView(tuple(rows), tuple(valid))
