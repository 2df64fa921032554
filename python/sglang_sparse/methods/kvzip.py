"""KVzip (Kim et al., 2025): query-agnostic KV eviction scored by context reconstruction.

After the context (the prompt, ``[0, P)``) is prefilled, a reconstruction probe is prefilled
after it: "repeat the previous context" followed by the context itself, teacher-forced
(``probe_tokens``). Importance of context position j in layer l, KV head h = the max over probe
queries and over the query heads of h's GQA group of their causal softmax attention to j
(``sgl_kernel_sparse.reference.kvzip_probe_scores``, fp32). One global selection over every
(layer, KV head, position) keeps ``floor(keep_ratio * layers * kv_heads * P)`` entries, the first
``sinks`` positions of every head first (``reference.kvzip_keep_mask``). The probe's own rows are
all dropped; decode continues at logical position P.

Logical vs retained rows: while the probe runs the request holds rows ``[0, P + S)`` (context,
then the S probe tokens, identity map). The compaction keeps in layer l ``B_l`` rows per KV head
(logical positions ``< P``) in the per-layer flat-cell store (``CacheManager.compact_layers``,
as PyramidKV), so each layer frees its own drops; afterwards ``logical_len = P`` and new tokens
take rows after the packed region.

Choices the paper leaves open (or that the store imposes):

- the store holds one row count per layer, so a layer keeps ``B_l = max_h n_{l,h}`` rows per
  head (at least 1): a head under that count also keeps its next-best positions (score order,
  ties to the lower position) up to it. Memory freed is therefore at least what the global
  threshold frees per layer's widest head, not per head;
- ties in the global selection go to the earlier (layer, head, position) entry;
- the probe attends to the whole context and the probe so far (one sequence, chunked like any
  prefill); the paper's implementation scores each 2048-token context chunk with its own probe
  that sees the sinks, that chunk and itself. The two agree for contexts up to one chunk;
  ``probe_tokens`` builds the paper's chunked probe text (the previous chunk's last ``tail``
  tokens start each later chunk), all chunks in one sequence;
- the probe runs in the engine as more prefill of the same request: the engine starts the
  request with ``metadata={"kvzip_context": P}`` and a prompt of ``P + S`` tokens;
- served (``srt/api/probe.py``, ``srt/engine/probe.py``): for a client prompt of N tokens the
  engine prefills ``context = prompt[:N-1]`` (P = N - 1) + the probe, the compaction drops every
  probe row (``logical_len = P``), and the prompt's last token is then fed as the first decode
  input at logical position ``N - 1`` (RoPE position too): the first generated token is predicted
  from the prompt's last token over the compacted context, never from the end of the probe. The
  last prompt token is therefore never scored and always kept (every layer and head; its row is
  written after the compaction). A one-token prompt has no context to score: it is served with
  no probe. ``meta_info.prompt_tokens`` is the client's N;
- Chain Cache is off (a continuation would need its own probe over the resumed rows): a request
  naming a ``chain_id`` is refused with 400, ``--chain-cache on`` at launch with a sentence.
- limits of the served path: prompt + probe (a little over twice the prompt) must fit the
  server's input limit (400 naming the prompt's field otherwise); a request SGLang retracts
  (KV pool exhausted mid-decode) is re-prefilled without the probe (its prompt then holds the
  probe tokens: served dense, output no longer the method's); logprobs of the prompt include the
  probe tokens.

Parameters: ``keep_ratio`` (0, 1], ``sinks`` (4), ``chunk`` (2048 context tokens per probe chunk),
``tail`` (8).

Counters (``/sparse/stats``), as the other eviction methods: ``evictions`` (compactions, one per
probed request), ``rows_released`` (layer rows freed, summed over layers: a request holding
``P + S`` rows that keeps ``B_l`` in layer l releases ``sum_l (P + S - B_l)``, the probe's rows
included; divide by the layer count for token slots); ``kvzip_probes`` (scored requests) and
``kvzip_padded_entries`` (entries kept only because their layer's widest head kept more).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sgl_kernel_sparse.reference import KVZIP_SINKS, kvzip_keep_mask, kvzip_probe_scores

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.pruning import kvzip_prompt_ids
from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.views import CellsDecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method

CONTEXT_KEY = "kvzip_context"  # request metadata: the context length P (the probe follows it)
QUERY_BLOCK = 256  # probe queries scored at once (bounded memory: [Hq, block, P + S] fp32)


@dataclass(frozen=True)
class KVzipConfig:
    keep_ratio: float = 0.5
    sinks: int = KVZIP_SINKS
    chunk: int = 2048
    tail: int = 8

    def validate(self) -> None:
        if not 0.0 < float(self.keep_ratio) <= 1.0:
            raise ConfigError(f"keep_ratio={self.keep_ratio} is out of range: must be in (0, 1] "
                              "(the fraction of context KV entries kept over all layers and heads)")
        check_range("sinks", self.sinks, 0)
        check_range("chunk", self.chunk, 16)
        check_range("tail", self.tail, 0, self.chunk)


def probe_tokens(context: list[int], repeat: list[int], repeat_part: list[int], suffix: list[int],
                 chunk: int, tail: int) -> list[int]:
    """The reconstruction probe's token ids for a context: per chunk of ``chunk`` context tokens,
    ``repeat`` (first chunk) or ``repeat_part`` + the previous chunk's last ``tail`` tokens,
    then ``suffix`` and the chunk itself (teacher-forced reconstruction)."""
    out: list[int] = []
    for i in range(0, max(len(context), 1), chunk):
        head = repeat if i == 0 else repeat_part + context[max(0, i - tail): i]
        out += head + suffix + context[i: i + chunk]
    return out


def widen_to_layer(mask: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """One layer's kept positions ``[Hkv, B]`` (ascending) from its global mask ``[Hkv, P]``:
    ``B = max(1, max_h kept_h)``; a head with fewer also keeps its next-best positions (score
    descending, ties to the lower position) up to B."""
    width = max(1, int(mask.sum(dim=1).max()))
    rank = torch.where(mask, torch.full_like(scores, float("inf")), scores.float())
    order = torch.sort(-rank, dim=1, stable=True).indices[:, :width]
    return torch.sort(order, dim=1).values


@register_method("kvzip", "eviction", KVzipConfig, "context-reconstruction scores, one global keep ratio")
class KVzipRuntime(EvictingRuntime):
    per_layer_rows = True
    graph_decode = True  # decode reads each layer's rows through the cell tables (as PyramidKV)
    supports_chains = False
    needs_engine_probe = True  # the engine must prefill ``probe_tokens`` after the prompt

    def __init__(self, cache, config: KVzipConfig | None = None) -> None:
        self.config = config or KVzipConfig()
        super().__init__(cache, MemoryOracle(retained_budget=None))
        self.tables = self.cache.enable_cell_tables()
        self.counters = {"evictions": 0, "rows_released": 0, "kvzip_probes": 0, "kvzip_padded_entries": 0}

    @classmethod
    def probe_ids(cls, config: KVzipConfig, context: list[int], encode) -> list[int]:
        """The chunked reconstruction probe after ``context`` (texts shared with ``/prune``)."""
        repeat, repeat_part = kvzip_prompt_ids(encode)
        return probe_tokens(context, repeat, repeat_part, [], config.chunk, config.tail)

    def probe_metadata(self, context_len: int) -> dict:
        return {CONTEXT_KEY: context_len}

    def decode_view_tensors(self, batch: DecodeBatch) -> CellsDecodeView:
        return CellsDecodeView(self.tables, batch.layer_id)

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        """Buffer the probe's queries (logical positions ``[P, P + S)``) as their chunks pass."""
        for i, r in enumerate(layer.step.requests):
            meta = self.cache.requests[r.rid].metadata
            ctx = meta.get(CONTEXT_KEY)
            if ctx is None or not r.is_prefill or r.logical_end <= ctx:
                continue
            q = layer.request_tokens(i, layer.q)[max(0, ctx - r.logical_start):]
            meta.setdefault("probe_q", {}).setdefault(layer.layer_id, []).append(q.detach().clone())

    def finish_step(self, step: StepInfo) -> None:
        for r in step.requests:
            meta = self.cache.requests[r.rid].metadata
            if r.is_last_prompt_chunk and meta.get(CONTEXT_KEY) is not None and meta.get("probe_q"):
                self.schedule(r.rid)

    def scores(self, rid: str) -> torch.Tensor:
        """``[layers, Hkv, P]`` reconstruction scores of the context (from the buffered probe)."""
        state = self.cache.requests[rid]
        ctx, probe_q = state.metadata[CONTEXT_KEY], state.metadata.pop("probe_q")
        out = []
        for layer in range(self.cache.store.num_layers):
            q = torch.cat(probe_q[layer])  # [S, Hq, D], logical positions [P, P + S)
            keys = self.cache.keys(rid, layer)  # identity rows: row j = position j
            best = None
            for b in range(0, q.shape[0], QUERY_BLOCK):
                pos = torch.arange(ctx + b, ctx + min(b + QUERY_BLOCK, q.shape[0]))
                s = kvzip_probe_scores(q[b: b + QUERY_BLOCK], keys, pos.to(keys.device), ctx).cpu()
                best = s if best is None else torch.maximum(best, s)
            out.append(best)
        return torch.stack(out)

    def plan(self, rid: str) -> list[torch.Tensor]:
        scores = self.scores(rid)
        mask = kvzip_keep_mask(scores, self.config.keep_ratio, self.config.sinks)
        keep = [widen_to_layer(mask[layer], scores[layer]) for layer in range(scores.shape[0])]
        self.counters["kvzip_probes"] += 1
        self.counters["kvzip_padded_entries"] += sum(k.numel() for k in keep) - int(mask.sum())
        held = self.cache.requests[rid].retained.n_rows  # P + S: the context and the probe
        self.bump("evictions")
        self.bump("rows_released", sum(held - k.shape[1] for k in keep))
        return keep

    def apply_pending(self, only: set[str] | None = None) -> int:
        done = [rid for rid in self.pending if only is None or rid in only]
        freed = super().apply_pending(only)
        for rid in done:  # the probe's rows are gone: the request continues after its context
            state = self.cache.requests.get(rid)
            if state is not None:
                ctx = state.metadata.pop(CONTEXT_KEY)
                state.retained.logical_len = state.prompt_len = ctx
        return freed
