"""OmniKV (Hao et al., ICLR 2025): token selection at a few filter layers, reused by the layers
after them; the full KV stays resident (nothing is evicted).

At each decode step, in every filter layer (``filter_layers``, e.g. 2, 8, 18) and for each
request, the current query scores the request's prompt tokens::

    s_j = max_h softmax_j(q_h . k_j / sqrt(d))      (softmax over all resident rows of the request,
                                                    max over the query heads)

and the top ``token_budget`` prompt tokens are kept, in ascending order. The layers after a filter
layer, up to the next one, attend only that set plus every generated token of the request (rows
from the end of the prompt on, this token included). Layers before the first filter layer and the
filter layers themselves attend densely; prefill is dense. A prompt of at most ``token_budget``
tokens is attended in full (the selection would be all of it).

Index ranges: OmniKV never evicts, so a request's rows are its logical positions, except on a
radix path that ``/prune`` pruned, where rows ``[0, P)`` stand for ``N`` logical tokens
(``RequestSlice.logical_start - row_start`` is that gap): the prompt's rows are then
``[0, prompt_len - gap)``. Selection and attention work on rows.

Simplified from the paper: scores use ``1 / sqrt(d)`` (the model's own attention scale is not part
of a layer's input here; the two agree for the default model and Llama / Qwen shapes), and decode
runs its selection in Python per layer, so on the GPU the launcher turns decode CUDA graphs off
(``decode_needs_python``) until a tensor-only path exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sglang_sparse.core.events import LayerInput, StepInfo
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.core.views import DecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method


@dataclass(frozen=True)
class OmniKVConfig:
    filter_layers: str = "2,8,18"  # comma-separated layer ids, ascending
    token_budget: int = 2048  # prompt tokens kept at each filter layer

    @property
    def layers(self) -> tuple[int, ...]:
        try:
            layers = tuple(int(x) for x in self.filter_layers.split(","))
        except ValueError:
            raise ConfigError(f"filter_layers={self.filter_layers!r} must be comma-separated layer ids, "
                              "e.g. 2,8,18") from None
        if any(a < 0 for a in layers) or list(layers) != sorted(set(layers)):
            raise ConfigError(f"filter_layers={self.filter_layers!r} must be distinct layer ids >= 0 in "
                              "ascending order, e.g. 2,8,18")
        return layers

    def validate(self) -> None:
        _ = self.layers
        check_range("token_budget", self.token_budget, 1)


def token_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """OmniKV's score per row: ``max_h softmax_j(q_h . k_j / sqrt(d))``. q ``[H_q, d]``, k ``[n,
    H_kv, d]`` (grouped-query heads share their KV head); returns ``[n]`` float32."""
    group = q.shape[0] // k.shape[1]
    kq = k.float().repeat_interleave(group, dim=1)  # [n, H_q, d]
    logits = torch.einsum("hd,nhd->hn", q.float(), kq) / math.sqrt(q.shape[-1])
    return logits.softmax(dim=-1).amax(dim=0)


def select_prompt_rows(scores: torch.Tensor, prompt_rows: int, budget: int) -> torch.Tensor:
    """The top ``budget`` of the prompt's rows ``[0, prompt_rows)`` by score, ascending (int64).
    Ties go to the lower row (a stable sort on the negated scores)."""
    order = torch.sort(-scores[:prompt_rows], stable=True).indices[:budget]
    return order.sort().values


@register_method("omnikv", "dynamic selection", OmniKVConfig,
                 "top prompt tokens chosen at filter layers, reused by the later layers")
class OmniKVRuntime(SparseMethodRuntime):
    def __init__(self, cache, config: OmniKVConfig | None = None) -> None:
        super().__init__(cache)
        self.config = config or OmniKVConfig()
        self.filters = self.config.layers
        n = cache.store.num_layers
        if self.filters[-1] >= n:
            raise ConfigError(f"filter_layers={self.config.filter_layers!r}: the model has {n} layers "
                              f"(ids 0 to {n - 1})")
        # rid -> prompt rows chosen by the latest filter layer of the current decode step
        # (cleared after every step: each step's first filter layer chooses anew)
        self.selected: dict[str, torch.Tensor] = {}

    @staticmethod
    def _prompt_rows(r) -> int:
        """Rows of the prompt: its logical length minus the request's gap on a pruned path."""
        return r.prompt_len - (r.logical_start - r.row_start)

    def build_decode_selection(self, layer: LayerInput) -> DecodeView | None:
        lid = layer.layer_id
        if lid < self.filters[0]:
            return None
        if lid in self.filters:
            self._filter(layer)
            return None  # a filter layer attends densely
        if not self.selected:
            return None
        rows, valid = [], []
        hq = layer.q.shape[1]
        for r in layer.step.requests:
            n = r.row_start + r.num_tokens  # resident rows incl. this token
            sel = self.selected.get(r.rid)
            if sel is None:  # attended in full
                idx = torch.arange(n, device=layer.q.device)
            else:  # the chosen prompt rows, then every generated row
                idx = torch.cat([sel, torch.arange(self._prompt_rows(r), n, device=sel.device)])
            self.bump("rows_read", idx.numel())
            self.bump("rows_resident", n)
            rows.append(idx.expand(hq, -1))
            valid.append(torch.ones(hq, idx.numel(), dtype=torch.bool, device=idx.device))
        return DecodeView(tuple(rows), tuple(valid))

    def _filter(self, layer: LayerInput) -> None:
        """Score every request's prompt rows from this layer's query; keep the top budget."""
        store, budget = self.cache.store, self.config.token_budget
        k_cache = store.k_buffer(layer.layer_id)
        for i, r in enumerate(layer.step.requests):
            p = self._prompt_rows(r)
            if p <= budget:
                self.selected.pop(r.rid, None)
                continue
            n = r.row_start + r.num_tokens
            k = k_cache[store.row_slots(r.req_row, 0, n).to(torch.int64)]
            scores = token_scores(layer.request_tokens(i, layer.q)[-1], k)
            self.selected[r.rid] = select_prompt_rows(scores, p, budget).to(layer.q.device)
            self.bump("filter_selections")

    def finish_step(self, step: StepInfo) -> None:
        self.selected.clear()
