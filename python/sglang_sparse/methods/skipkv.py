"""SkipKV (Tian et al., MLSys 2026): sentence-level eviction, whole segments dropped, for long
reasoning outputs. What is built here is the storage side: the KV of whole sentences is skipped.

Segments (``sgl_kernel_sparse.eviction_scores.segment_ids``): a segment ends at a token whose
decoded text, trailing spaces and tabs stripped, ends with ``.``, ``?``, ``!`` (or ``。？！``) or
contains a newline (``ends_sentence``), and after ``max_segment`` tokens (a longer sentence is cut
into pieces of ``max_segment``: the rule for a segment bigger than the budget). The runtime
``reads_tokens``: the engine adapter passes each step's token ids and, once at start-up, the
decoded text of every token id (``use_vocabulary``), from which a boolean boundary table by token
id is built. Segment ids are per logical position, so they never change when rows are evicted;
without a vocabulary (an engine with no tokenizer) no token is a boundary and segments are
``max_segment`` pieces. A request's segments travel in its metadata (Chain Cache).

Scores: as H2O, the accumulated softmax attention every query (prompt and decode) paid each row,
per layer and KV head, summed over the GQA group (``core.slot_scores``: per slot, tensor-only
decode inside CUDA graphs, ``graph_decode``). A segment's score is the mean of its rows' scores
over the rows, the layers and the KV heads (a mean, so long and short sentences compare).

Selection (``eviction_scores.skipkv_select``), shared by every layer and KV head: a sentence is
kept or skipped as a whole, so the plan is 1-D (``CacheManager.compact_tokens``: no KV moves,
the kept rows keep their slots and so their scores). Rows ``[0, sinks)`` (attention sinks) and
the last ``recent`` rows are always kept; of the rows between, the segments are dropped lowest
score first (ties: the later segment first, the lower row stays) until at most ``budget`` rows
remain. A segment cut by the sinks or the recent window keeps the part inside them; the rest is
dropped or kept on its own. A request then holds between ``budget - max_segment + 1`` and
``budget`` rows after an eviction (not exactly ``budget``, unlike H2O).

When: as H2O, whenever a step leaves a request ``interval`` or more rows past ``budget`` -- a
decode token or, with ``evict_prefill=on`` (the default), a prompt chunk -- and after the prompt's
last chunk if over ``budget`` at all. Between prompt chunks the engine compacts at its safe point
exactly as for H2O (``srt/engine/steps.compact_chunked``): the next chunk's queries see only the
kept rows, a prompt holds at most ``budget + interval - 1 + chunk`` rows while prefilled, and
admission counts that (``MemoryOracle.prefill_cap``), not the whole prompt. A sentence still open
at a chunk's end is cut by the recent window as any segment (its part inside is kept; its segment
id goes on in the next chunk). ``evict_prefill=off``
holds the prompt whole until its last chunk (the kept set then does not depend on the chunk size;
``eviction_scores.skipkv_simulate`` is the reference for both).

Not done (the paper leaves these to its own code or they are outside a KV runtime): its sentence
score combines attention importance with token redundancy and a pairwise sentence similarity of
last-layer hidden states (near-duplicate sentences go first); here only the attention mean is
used. Its steering vector (skipping *generation* of redundant thoughts by shifting activations)
and its batch grouping are not implemented. The default model (SmolLM2-135M) is not a reasoning
model: on it this shows the runtime mechanism (sentences found, scored and dropped whole, slots
freed), not the paper's accuracy. Softmax scale ``1/sqrt(d)`` as H2O.

Counters (``/sparse/stats``): ``evictions``, ``rows_released``, ``segments_dropped`` (segments of
which no row is left), ``segment_boundaries`` (sentence ends seen in the token stream). Costs:
the tokenizer is loaded once in the scheduler (about 2.5 s for SmolLM2's 49K ids on the CPU), a
segment id per logical token per request (8 bytes, host), the per-slot scores as H2O.

Parameters: ``budget`` rows kept per request (every layer and head), ``sinks`` first rows always
kept, ``recent`` last rows always kept, ``interval`` eviction slack while decoding,
``max_segment`` the longest segment (``<= budget - sinks - recent``, so any segment fits),
``evict_prefill`` on|off (evict between prompt chunks, default on).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import torch
from sgl_kernel_sparse.eviction_scores import skipkv_select

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import RequestSlice, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.slot_scores import AccumulatedAttentionHooks, SlotScores
from sglang_sparse.registry import ConfigError, check_evict_prefill, check_range, register_method

SENTENCE_END = ".?!。？！"


def ends_sentence(text: str) -> bool:
    """The boundary rule: the token's text ends a sentence (see the module docstring)."""
    return "\n" in text or text.rstrip(" \t")[-1:] in tuple(SENTENCE_END)


@dataclass(frozen=True)
class SkipKVConfig:
    budget: int = 1024
    sinks: int = 4
    recent: int = 128
    interval: int = 32
    max_segment: int = 64
    evict_prefill: str = "on"  # "on" | "off": also evict between prompt chunks (as H2O)

    def validate(self) -> None:
        check_evict_prefill(self.evict_prefill)
        check_range("sinks", self.sinks, 0)
        check_range("recent", self.recent, 1)
        check_range("interval", self.interval, 1)
        check_range("max_segment", self.max_segment, 1)
        room = self.budget - self.sinks - self.recent  # rows for whole segments
        if room < self.max_segment:
            raise ConfigError(f"budget={self.budget} is out of range: must be >= sinks + recent + max_segment = "
                              f"{self.sinks + self.recent + self.max_segment} (room for one whole segment; lower "
                              "--sparse-recent or --sparse-max-segment with the budget)")


@dataclass
class Segments:
    """A request's segment id per logical position ``[0, len(ids))`` and the rule's state."""

    ids: array = field(default_factory=lambda: array("q"))
    run: int = 0  # tokens in the last segment so far
    closed: bool = True  # the last token ended its segment (or no token yet)

    def extend(self, flags: list[bool], max_segment: int) -> None:
        seg = self.ids[-1] if self.ids else -1
        for b in flags:
            if self.closed or self.run >= max_segment:
                seg, self.run = seg + 1, 0
            self.ids.append(seg)
            self.run += 1
            self.closed = b

    def copy(self) -> "Segments":
        return Segments(array("q", self.ids), self.run, self.closed)


@register_method("skipkv", "eviction", SkipKVConfig, "sentence-level eviction: whole segments dropped by attention")
class SkipKVRuntime(AccumulatedAttentionHooks, EvictingRuntime):
    graph_decode = True
    reads_tokens = True

    def __init__(self, cache, config: SkipKVConfig | None = None) -> None:
        self.config = config or SkipKVConfig()
        c = self.config
        self.evict_prefill = c.evict_prefill == "on"
        super().__init__(cache, MemoryOracle.online(c.budget, c.interval, self.evict_prefill))
        self.scores = SlotScores(cache.store, cache.kv_heads)
        self.boundary = torch.zeros(0, dtype=torch.bool)  # by token id; ids past its end: no boundary

    def use_vocabulary(self, texts: list[str]) -> None:
        self.boundary = torch.tensor([ends_sentence(t) for t in texts], dtype=torch.bool)

    def on_request_start(self, rid: str) -> None:
        meta = self.cache.requests[rid].metadata
        # a resumed chain's segments are copied: the parked record keeps its own
        meta["segments"] = meta["segments"].copy() if "segments" in meta else Segments()

    def track(self, r: RequestSlice) -> None:
        """Segment ids of the slice's new logical positions (positions never seen, e.g. a cached
        prefix without metadata, count as non-boundary tokens)."""
        segs = self.cache.requests[r.rid].metadata["segments"]
        known = len(segs.ids)
        if known >= r.logical_end:
            return
        ids = list(r.token_ids[max(known - r.logical_start, 0):])
        unknown = r.logical_end - known - len(ids)
        ids = torch.tensor(ids, dtype=torch.int64)
        table = self.boundary
        flags = torch.zeros(len(ids), dtype=torch.bool)
        inside = ids < table.numel()
        flags[inside] = table[ids[inside]]
        self.bump("segment_boundaries", int(flags.sum()))
        segs.extend([False] * unknown + flags.tolist(), self.config.max_segment)

    def finish_step(self, step: StepInfo) -> None:
        for r in step.requests:
            if r.rid in self.cache.requests:
                self.track(r)
        self.schedule_over_budget(step, self.config.budget, self.config.interval, during_prefill=self.evict_prefill)

    def plan(self, rid: str) -> torch.Tensor | None:
        c = self.config
        state = self.cache.requests[rid]
        n = state.retained.n_rows
        if n <= c.budget:
            return None
        held = state.retained.token_positions()  # [n] logical position of row i (every layer and head)
        if held is None:
            raise RuntimeError("skipkv keeps the same tokens in every layer and head; this request's map is per head")
        seg = torch.frombuffer(state.metadata["segments"].ids, dtype=torch.int64)[held]  # [n] segment of row i
        scores = self.scores.rows(self.cache.resident_slots(rid))  # [layers, Hkv, n], this rank's heads
        scores = self.cache.heads.gather(scores, dim=1)  # every rank's heads: the same rows kept on each
        rows = skipkv_select(scores, seg, c.budget, c.sinks, c.recent).cpu()  # kept rows, ascending
        self.bump("evictions")
        self.bump("segments_dropped", int(seg.unique_consecutive().numel() - seg[rows].unique_consecutive().numel()))
        self.bump("rows_released", n - rows.numel())
        return held[rows]  # logical positions, shared by every layer and head
