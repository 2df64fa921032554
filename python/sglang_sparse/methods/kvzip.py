"""KVzip (Kim et al., 2025): query-agnostic KV eviction scored by context reconstruction.

After the context (the prompt, ``[0, P)``) is prefilled, a reconstruction probe is prefilled
after it: "repeat the previous context" followed by the context itself, teacher-forced
(``probe_tokens``). Importance of context position j in layer l, KV head h = the max over probe
queries and over the query heads of h's GQA group of their causal softmax attention to j
(``sgl_kernel_sparse.reference.kvzip_probe_scores``, fp32; on CUDA a two-pass Triton kernel,
``triton_kvzip``, that never holds the probe's attention matrix). One global selection over every
(layer, KV head, position) keeps ``floor(keep_ratio * layers * kv_heads * P)`` entries, the first
``sinks`` positions of every head first (``reference.kvzip_keep_mask``). The probe's own rows are
all dropped; decode continues at logical position P.

Logical vs retained rows: while the probe runs the request holds rows ``[0, P + S)`` (context,
then the S probe tokens, identity map); a chain continuation holds ``R_l`` resumed rows in layer l
(logical positions ``< M``, per head) and then rows for ``[M, P + S)`` in order, so row
``R_l + (x - M)`` holds logical position x there. The compaction keeps in layer l ``B_l`` rows per KV head
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
- Chain Cache (on by default, as for every method that evicts): a turn parks its compacted rows;
  a continuation that resumes M logical tokens prefills only its new context ``[M, P)`` and a
  probe over that context alone, built as the paper builds the probe of a later context chunk
  (``repeat_part`` + the last ``tail`` tokens before M, then the new tokens, in chunks; the
  scheduler builds it once it knows M, ``srt/engine/probe.rebase``). The probe's queries attend
  to everything the request holds (the resumed rows of earlier turns, the new context, the probe
  so far); only the new context ``[M, P)`` is scored and selected, by the same global rule over
  its ``layers * kv_heads * (P - M)`` entries (sinks only where they fall in it); the resumed
  rows stay as earlier turns kept them. A continuation with no new context (the prompt extends
  the chain by its last token only) runs no probe;
- SGLang sessions (``session_params``) are refused with 400: SGLang builds a session's next
  prompt from the previous one, probe included; continue with ``chain_id`` instead;
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
from sgl_kernel_sparse import kvzip_probe_scores
from sgl_kernel_sparse.reference import KVZIP_SINKS, kvzip_keep_mask

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.pruning import kvzip_prompt_ids
from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.views import CellsDecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method

CONTEXT_KEY = "kvzip_context"  # request metadata: the context length P (the probe follows it)
START_KEY = "kvzip_start"  # request metadata: M, the first context position scored (a resumed chain's)
QUERY_BLOCK = 256  # CPU: probe queries scored at once (memory [Hq, block, P + S] fp32); CUDA: one Triton call


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
                 chunk: int, tail: int, start: int = 0) -> list[int]:
    """The reconstruction probe's token ids for ``context[start:]``: per chunk of ``chunk``
    context tokens from ``start``, ``repeat`` (a chunk at position 0) or ``repeat_part`` + the
    ``tail`` tokens before the chunk, then ``suffix`` and the chunk itself (teacher-forced
    reconstruction). ``start > 0``: a chain continuation's new context, probed as a later chunk."""
    out: list[int] = []
    for i in range(start, max(len(context), start + 1), chunk):
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


def _resumed_rows(ret, layer: int, start: int) -> int:
    """Rows of ``layer`` before a continuation's new context (positions ``< start``)."""
    if not ret.per_layer:
        return start  # identity rows (a chain whose earlier turns were never compacted)
    return int((ret.layer_positions(layer)[0] < start).sum())


@register_method("kvzip", "eviction", KVzipConfig, "context-reconstruction scores, one global keep ratio")
class KVzipRuntime(EvictingRuntime):
    per_layer_rows = True
    graph_decode = True  # decode reads each layer's rows through the cell tables (as PyramidKV)
    needs_engine_probe = True  # the engine must prefill ``probe_tokens`` after the prompt

    def __init__(self, cache, config: KVzipConfig | None = None) -> None:
        self.config = config or KVzipConfig()
        super().__init__(cache, MemoryOracle(retained_budget=None))
        self.tables = self.cache.enable_cell_tables()
        self.counters = {"evictions": 0, "rows_released": 0, "kvzip_probes": 0, "kvzip_padded_entries": 0}

    @classmethod
    def probe_texts(cls, encode) -> dict:
        """The probe's fixed token ids (texts shared with ``/prune``), for ``probe_ids``."""
        repeat, repeat_part = kvzip_prompt_ids(encode)
        return {"repeat": repeat, "repeat_part": repeat_part}

    @classmethod
    def probe_ids(cls, config: KVzipConfig, context: list[int], texts: dict, start: int = 0) -> list[int]:
        """The chunked reconstruction probe of ``context[start:]``, to prefill after ``context``."""
        return probe_tokens(context, texts["repeat"], texts["repeat_part"], [], config.chunk, config.tail, start)

    def probe_metadata(self, context_len: int, start: int = 0) -> dict:
        return {CONTEXT_KEY: context_len, START_KEY: start}

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

    def scores(self, rid: str) -> tuple[torch.Tensor, list[int]]:
        """``[layers, Hkv, P - M]`` reconstruction scores of the new context ``[M, P)`` (from the
        buffered probe), and per layer the count ``R_l`` of resumed rows before it (0 unless the
        request resumed a chain)."""
        state = self.cache.requests[rid]
        ctx, probe_q = state.metadata[CONTEXT_KEY], state.metadata.pop("probe_q")
        start = state.metadata.get(START_KEY, 0)
        out, resumed = [], []
        for layer in range(self.cache.store.num_layers):
            q = torch.cat(probe_q[layer])  # [S, Hq, D], logical positions [P, P + S)
            keys = self.cache.keys(rid, layer)  # [rows, Hkv, D], row order
            # rows [0, R) hold resumed positions < M (all visible to the probe); row R + (x - M)
            # holds logical position x >= M, so the causal mask compares rows
            r = _resumed_rows(state.retained, layer, start)
            rows = torch.arange(ctx, ctx + q.shape[0], device=keys.device) - start + r
            best = kvzip_probe_scores(q, keys, rows, r + ctx - start, query_block=QUERY_BLOCK)
            out.append(best[:, r:].cpu())
            resumed.append(r)
        return torch.stack(out), resumed

    def plan(self, rid: str) -> list[torch.Tensor]:
        state = self.cache.requests[rid]
        start = state.metadata.get(START_KEY, 0)
        scores, resumed = self.scores(rid)
        # the selection is global over heads: under tensor parallelism it sees every rank's heads,
        # so each layer's width B_l (the rows its slots hold) is the same on every rank
        heads = self.cache.heads
        scores = heads.gather(scores, dim=1)
        # sinks are the sequence's first positions: in a continuation's new context only if M < sinks
        mask = kvzip_keep_mask(scores, self.config.keep_ratio, max(0, self.config.sinks - start))
        every_head = [widen_to_layer(mask[layer], scores[layer]) for layer in range(scores.shape[0])]
        widened = [heads.local(w, dim=0) for w in every_head]  # this rank's heads
        ret = state.retained  # earlier turns' kept rows (positions < M) stay as they are
        keep = [torch.cat([ret.layer_positions(layer)[:, :r], start + w], dim=1)
                for layer, (r, w) in enumerate(zip(resumed, widened))]
        self.counters["kvzip_probes"] += 1
        self.counters["kvzip_padded_entries"] += sum(w.numel() for w in every_head) - int(mask.sum())  # all heads
        self.bump("evictions")  # each layer held its resumed rows, then the new context and the probe
        self.bump("rows_released", sum(ret.layer_len(layer) - k.shape[1] for layer, k in enumerate(keep)))
        return keep

    def apply_pending(self, only: set[str] | None = None) -> int:
        done = [rid for rid in self.pending if only is None or rid in only]
        freed = super().apply_pending(only)
        for rid in done:  # the probe's rows are gone: the request continues after its context
            state = self.cache.requests.get(rid)
            if state is not None:
                ctx = state.metadata.pop(CONTEXT_KEY)
                state.metadata.pop(START_KEY, None)
                state.retained.logical_len = state.prompt_len = ctx
        return freed
