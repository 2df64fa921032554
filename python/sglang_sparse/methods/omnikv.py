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

Decode is tensor-only (``graph_decode``), so SGLang's decode CUDA graphs capture it: a filter layer
computes every resident row's logit through the slot table (``token_logits``, one Triton launch
on CUDA), the scores and a stable top-k in torch, and writes the chosen rows into a persistent
buffer indexed by batch position; the later layers attend those rows plus the tail ``[prompt
rows, n_rows)`` (``rows_tail_decode_attention``). The prompt's row count per engine row is set in
prefill (eager hooks). Every tensor has a fixed shape (``[B, H_q, L]`` logits, ``L`` the slot
table's width), so graph replays need no host sync.

Simplified from the paper: scores use ``1 / sqrt(d)`` (the model's own attention scale is not part
of a layer's input here; the two agree for the default model and Llama / Qwen shapes); the
selection is recomputed at every decode step (the paper's implementation may reuse it for a few
steps); the filter layers' logits are a separate pass over the keys next to their dense
attention, not fused into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo, StepMode
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.core.tensor_parallel import SingleRank
from sglang_sparse.core.views import RowsTailDecodeView
from sglang_sparse.kernels import stable_topk, token_logits
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


def select_from_logits(logits: torch.Tensor, prompt_rows: torch.Tensor, budget: int,
                       heads: SingleRank | None = None) -> torch.Tensor:
    """OmniKV's selection from one filter layer's logits ``[B, H_q, L]`` (``-inf`` past each
    request's rows): ``s_j = max_h softmax_j``, the top ``budget`` rows of ``[0, prompt_rows[b])``
    by ``s``, ties to the lower row (a stable sort), ascending, ``-1`` where the prompt has fewer
    rows. Returns int32 ``[B, budget]``. Tensor ops only (graph-safe). Under tensor parallelism
    ``heads`` takes the maximum over every rank's heads (one all-reduce), so all ranks read the
    same rows."""
    scores = logits.softmax(dim=-1).amax(dim=1)  # [B, L], over this rank's query heads
    if heads is not None:
        scores = heads.max_(scores)  # over every rank's
    beyond = torch.arange(scores.shape[1], device=scores.device).view(1, -1) >= prompt_rows.view(-1, 1)
    scores = scores.masked_fill(beyond, -1.0)  # a generated row is never chosen
    idx = stable_topk(scores, budget)
    sel = torch.where(scores.gather(1, idx) >= 0, idx, -1).to(torch.int32)
    if sel.shape[1] < budget:  # a slot table narrower than the budget
        sel = torch.nn.functional.pad(sel, (0, budget - sel.shape[1]), value=-1)
    return sel


@register_method("omnikv", "dynamic selection", OmniKVConfig,
                 "top prompt tokens chosen at filter layers, reused by the later layers")
class OmniKVRuntime(SparseMethodRuntime):
    graph_decode = True

    def __init__(self, cache, config: OmniKVConfig | None = None) -> None:
        super().__init__(cache)
        self.config = config or OmniKVConfig()
        self.filters = self.config.layers
        n = cache.store.num_layers
        if self.filters[-1] >= n:
            raise ConfigError(f"filter_layers={self.config.filter_layers!r}: the model has {n} layers "
                              f"(ids 0 to {n - 1})")
        # Allocated on first use (prefill, or SGLang's eager warm-up before a graph capture):
        self.prompt_rows: torch.Tensor | None = None  # [R] int32 by engine row: rows of the prompt
        # [R, budget] int32 by *batch position* (padded entries of a captured batch share engine
        # row 0 with a real request, so an engine-row index could collide): rows chosen by the
        # latest filter layer of the current decode step, -1 = padding
        self.selected: torch.Tensor | None = None

    def _buffers(self, table_rows: int, device) -> None:
        if self.prompt_rows is None:
            self.prompt_rows = torch.zeros(table_rows, dtype=torch.int32, device=device)
            self.selected = torch.full((table_rows, self.config.token_budget), -1, dtype=torch.int32,
                                       device=device)

    @staticmethod
    def _prompt_rows(r) -> int:
        """Rows of the prompt: its logical length minus the request's gap on a pruned path."""
        return r.prompt_len - (r.logical_start - r.row_start)

    # -- prefill and mixed steps (eager): remember where each request's prompt ends ----------
    def before_attention(self, layer: LayerInput) -> None:
        if layer.layer_id or layer.step.mode is StepMode.DECODE:
            return
        self._buffers(self.cache.store.table_shape()[0], layer.q.device)
        for r in layer.step.requests:
            if r.is_prefill:
                self.prompt_rows[r.req_row] = self._prompt_rows(r)

    # -- decode steps (tensor-only; captured into CUDA graphs) -------------------------------
    def decode_view_tensors(self, batch: DecodeBatch) -> RowsTailDecodeView | None:
        lid = batch.layer_id
        if lid < self.filters[0]:
            return None
        self._buffers(batch.table.shape[0], batch.q.device)
        b = batch.q.shape[0]
        prompt = self.prompt_rows[batch.req_rows.long()]
        if lid in self.filters:  # dense attention; choose for the layers up to the next filter
            logits = token_logits(batch.q, batch.k_cache, batch.table, batch.req_rows.long(), batch.n_rows)
            self.selected[:b] = select_from_logits(logits, prompt, self.config.token_budget, self.cache.heads)
            return None
        return RowsTailDecodeView(self.selected[:b], prompt, batch.n_rows)

    def finish_step(self, step: StepInfo) -> None:
        """Rows read and resident over the sparse layers, counted host-side (a replayed graph
        cannot): per request ``min(budget, p) + (n - p)`` of ``n`` resident rows, ``p`` the
        prompt's rows."""
        if step.mode is not StepMode.DECODE:
            return
        n_layers = self.cache.store.num_layers
        sparse_layers = n_layers - self.filters[0] - len(self.filters)
        budget = self.config.token_budget
        for r in step.requests:
            p, n = self._prompt_rows(r), r.row_start + r.num_tokens
            if p > budget:
                self.bump("filter_selections", len(self.filters))
            self.bump("rows_read", sparse_layers * (min(budget, p) + n - p))
            self.bump("rows_resident", sparse_layers * n)
