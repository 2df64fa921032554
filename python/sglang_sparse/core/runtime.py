"""SparseMethodRuntime: the per-method callbacks of the lifecycle contract (engine-agnostic).

Every hook is a no-op by default, so a method overrides only what it needs. Firing order in one
forward step (all in the scheduler process, on the rank that runs the model):

    prepare_step(step)                                   once, before the model runs
    for each layer l:
        before_attention(layer)                          every step
        on_prefill_chunk(layer)                          steps with prefill tokens
        build_decode_selection(layer) -> DecodeView|None decode steps (None: dense)
        <attention>
        after_attention(layer, out)                      every step
        on_layer_end(l, step)                            every step
    finish_step(step)                                    once, after the model ran

A method with ``graph_decode = True`` replaces the per-layer hooks of *decode* steps by one
tensor-only hook, ``decode_view_tensors(batch)``, which also runs while the engine captures a
CUDA graph and is then replayed without Python: it may only read and update persistent tensors
(see ``events.DecodeBatch``). Prefill and mixed steps keep the hooks above.

``finish_step`` may only *plan* physical changes (compaction, eviction): the controller applies
them at the engine's safe point via ``apply_pending`` (after the step's results are processed,
before the next step is scheduled), so in-flight work never sees rows move. Hooks that run
inside the forward (everything but ``prepare_step``/``finish_step``/``apply_pending``) must not
call ``.item()`` or loop over requests on a GPU hot path to stay CUDA-graph friendly; the CPU
implementation of the per-layer hooks does not meet that bar; ``decode_view_tensors`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.events import DecodeBatch, LayerInput, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.retained import RetainedMap
from sglang_sparse.core.retention import resident_positions
from sglang_sparse.core.views import DecodeView, PagedDecodeView


LAYER_HOOKS = ("before_attention", "on_prefill_chunk", "prefix_kv", "build_decode_selection",
               "after_attention", "on_layer_end")
# The per-layer hooks that fire in decode steps (``on_prefill_chunk`` never does).
DECODE_LAYER_HOOKS = ("before_attention", "build_decode_selection", "after_attention", "on_layer_end")


@dataclass(frozen=True)
class ModelRope:
    """What the engine hands a ``reads_rope`` runtime (``bind_model``): the model's RoPE table
    (``core.lowrank.RopeTable``) and what the method's ``prepare_artifacts`` returned."""

    rope: Any
    artifacts: dict


class SparseMethodRuntime:
    """Base class. Subclasses set ``name`` and usually override a few hooks."""

    name = "base"
    # Capabilities the engine adapter checks (never the method's name):
    changes_attention = True  # False: attention may run without the sparse backend (pass-through)
    evicts_kv = False  # True: releases KV slots during a request (needs physical eviction support)
    graph_decode = False  # True: decode layers go through decode_view_tensors (CUDA-graph safe)
    per_layer_rows = False  # True: compacts per layer (flat-cell store, LayerRowsView attention)
    # True: asks for SGLang's pool as one tensor over every layer (flat cells, ``kv_store``) so that
    # a batch of compactions moves every layer's rows in one kernel and reads any layer's keys in
    # one launch (R-KV, H2O); unlike ``per_layer_rows`` the method also runs without it (a layout
    # or an fp8 pool stored as bytes: ``CacheManager.flat_pool`` is None, one launch per layer)
    flat_kv_pool = False
    supports_chains = True  # False: Chain Cache cannot carry this method's state yet
    # True: an evicting method tested under SGLang's overlap scheduler (test_overlap_eviction_server.py);
    # the launcher refuses --sparse-overlap on for the others (methods that keep their KV never need it)
    overlap_tested = False
    needs_engine_probe = False  # True: the engine must prefill a method-built probe after the prompt
    # True: the adapter fills RequestSlice.token_ids and calls use_vocabulary once at start-up
    reads_tokens = False
    # True: the model's K/V projections are replaced by the method's (Palu's low-rank factors):
    # the adapter installs its projection hook after the model loads and calls ``bind_model``
    projects_kv = False
    # True: the method stores pre-RoPE K (DeltaKV): once the model is loaded the adapter calls
    # ``bind_model(ModelRope(...))`` with the model's RoPE table and the launcher's artifacts
    reads_rope = False
    # False: a ``graph_decode`` method whose decode kernel still runs Python (a plain-torch
    # reference with per-request loops): decode stays eager (no CUDA-graph capture)
    decode_kernel_graph_safe = True

    @classmethod
    def prepare_artifacts(cls, config, model_dir: str, argv: list[str], log) -> dict:
        """In the launcher, before the engine starts: build or find what the method needs from
        the model (e.g. factors computed from its weights), checking the model-dependent values
        (raise ``ConfigError`` with a sentence). Returns what the engine's processes need to find
        them (JSON-able; exported as ``config["artifacts"]``). Default: nothing."""
        return {}

    @classmethod
    def projection_factors(cls, config, artifacts: dict, num_layers: int, kv_heads: int, head_dim: int):
        """``projects_kv`` methods, in the engine once the model is loaded: the factors of the
        K/V projection (``core.lowrank.PaluFactors``) from what ``prepare_artifacts`` returned."""
        raise NotImplementedError

    def bind_model(self, info) -> None:
        """``projects_kv`` methods: what the projection hook took from the loaded model (factors,
        RoPE table); ``reads_rope`` methods: a ``ModelRope``. Given once before the first step."""

    @classmethod
    def probe_texts(cls, encode) -> dict:
        """``needs_engine_probe``: the probe's fixed parts as token ids (``encode(text)`` gives a
        text's ids, no special tokens), built once in the HTTP process for ``probe_ids``."""
        raise NotImplementedError

    @classmethod
    def probe_ids(cls, config, context: list[int], texts: dict, start: int = 0) -> list[int]:
        """``needs_engine_probe``: the probe's token ids that the engine prefills after
        ``context``, scoring ``context[start:]`` (``start`` > 0: a chain continuation's new
        context; the earlier tokens are the chain's)."""
        raise NotImplementedError

    def probe_metadata(self, context_len: int, start: int = 0) -> dict:
        """``needs_engine_probe``: the request metadata a request starts with whose prompt is
        ``context_len`` context tokens followed by ``probe_ids`` of ``context[start:]``
        (engine/probe.py)."""
        return {}

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """Whether this method replaces the no-op default of ``hook`` (callers skip the rest)."""
        return getattr(cls, hook) is not getattr(SparseMethodRuntime, hook)

    @classmethod
    def has_layer_hooks(cls) -> bool:
        """Whether any per-layer hook is overridden. Without one (dense) the adapter may skip the
        per-layer calls (defaults are no-ops) and keep the engine's fast paths (CUDA graphs)."""
        return cls.per_layer_rows or any(cls.overrides(h) for h in LAYER_HOOKS)

    @classmethod
    def decode_needs_python(cls) -> bool:
        """Whether decode steps run Python per layer (then the engine cannot replay a captured
        decode graph). False for methods without decode hooks (dense, SnapKV) and for
        ``graph_decode`` methods whose decode kernel is graph-safe (``decode_kernel_graph_safe``)."""
        if cls.graph_decode:
            return not cls.decode_kernel_graph_safe
        return any(cls.overrides(h) for h in DECODE_LAYER_HOOKS)

    @staticmethod
    def pool_split(config) -> float | None:
        """A method with its own KV store: the fraction of the pool's bytes the engine keeps as
        full-precision slots (the rest is the method's store); None: the engine keeps all."""
        return None

    @staticmethod
    def required_kv_cache_dtype(config) -> str | None:
        """The engine's KV storage dtype this configuration needs (SGLang's ``--kv-cache-dtype``
        where it serves the payload, e.g. ``fp8_e4m3``); None: the model's."""
        return None

    @staticmethod
    def required_page_size(config) -> int | None:
        """The engine page size (KV allocation unit) this configuration needs, e.g. for metadata
        kept per physical page; None: any."""
        return None

    def __init__(self, cache: CacheManager, oracle: MemoryOracle | None = None) -> None:
        self.cache = cache
        self.oracle = oracle or MemoryOracle()
        self.counters: dict[str, int] = {}  # events: the same on every tensor-parallel rank
        self.timings_us: dict[str, int] = {}  # host wall time of the method's own work (not events)

    def use_vocabulary(self, texts: list[str]) -> None:
        """``reads_tokens`` methods, once before the first step: ``texts[i]`` is the decoded text
        of token id i (the engine's tokenizer); not called when the engine has no tokenizer."""

    def payload_bytes(self) -> tuple[int, int]:
        """(total, used) bytes of KV the method stores outside the engine's pool (a quantized
        block store); the engine's pool is counted by the adapter."""
        return 0, 0

    def tier_stats(self) -> dict | None:
        """A method that keeps KV outside the device (RetroInfer's host tier): ``host_bytes_total``,
        ``host_bytes_used`` and per-tier figures (cache hits / misses, device bytes), reported by
        ``/sparse/stats`` and the ``host_bytes`` gauge; host bytes are never part of
        ``payload_bytes`` (device memory). None: one tier, the device."""
        return None

    def static_bytes(self) -> int:
        """Device bytes of method state that is not KV and does not grow with requests (Palu's
        factors); ``/sparse/stats`` reports it as ``method_static_bytes``."""
        return 0

    def payload_bytes_per_token(self) -> float | None:
        """Bytes per token of the method's own representation; None: the engine pool's."""
        return None

    def store_admits(self, prompt_len: int, max_new_tokens: int, others: list[tuple[str, int, int]],
                     cached: int = 0) -> bool:
        """Admission of a method with its own store (the engine's slots are checked by the
        engine): whether a request of ``prompt_len`` + ``max_new_tokens`` tokens fits the store
        next to ``others`` (``(rid, prompt_len, max_new_tokens)`` of the requests already running
        or admitted this round), counting what each still needs over its life; ``cached`` units
        of its prompt are shared from the radix cache. True by default."""
        return True

    def kept_positions(self, retained: RetainedMap, metadata: dict) -> list[torch.Tensor]:
        """The retention map of a running request or a parked chain with this map and metadata
        (``core/retention``): per layer ``[kv_heads, n_l]``, the ascending logical positions whose
        KV the method keeps. Default: the positions the resident rows hold. A method that keeps KV
        outside the engine's rows (quantized blocks, a host tier) adds those."""
        return resident_positions(retained)

    def bump(self, counter: str, n: int = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + n

    def add_time(self, what: str, seconds: float) -> None:
        """``/sparse/stats``' ``timings_us``: microseconds spent in ``what``, summed."""
        self.timings_us[what] = self.timings_us.get(what, 0) + int(seconds * 1e6)

    # -- request lifecycle -------------------------------------------------------------------
    def on_request_start(self, rid: str) -> None:
        """After the cache manager created the request's state."""

    def on_request_end(self, rid: str) -> None:
        """Before the cache manager drops the request's state."""

    def on_request_parked(self, rid: str) -> None:
        """The request's state (retained map + metadata) goes to a chain (Chain Cache) before it
        ends: whatever its metadata owns in a method store now belongs to the chain, so
        ``on_request_end`` must keep it. A resuming request gets that metadata back."""

    def release_parked(self, metadata: dict) -> None:
        """A parked chain is dropped (deleted, reclaimed, invalidated): free what ``metadata``
        owns in a method store."""

    # -- a method store's payload in the radix cache (KIVI's blocks) ---------------------------
    # ``prefix_unit`` > 0 (set per instance): the radix cache may keep the stored payload of
    # finished requests in *units* of that many logical tokens (a unit: a block of the store) and
    # start later requests on a cached prefix of them; 0: the tree never asks for units.
    prefix_unit = 0

    def cached_units(self, rid: str) -> list[int]:
        """Units that hold logical ``[0, len * prefix_unit)`` of the request, in order (what the
        radix cache may keep when it finishes)."""
        return []

    def hold_units(self, units: list[int]) -> None:
        """One more holder (a radix node) for each unit."""

    def drop_units(self, units: list[int]) -> None:
        """One holder fewer for each unit; a unit nobody holds goes back to the store."""

    def units_metadata(self, units: list[int]) -> dict:
        """The metadata of a request that starts on the cached prefix ``units`` (logical
        ``[0, len * prefix_unit)``): it becomes one more holder of each."""
        return {}

    def set_units_reclaim(self, reclaim) -> None:
        """``reclaim(n)``: the radix cache drops up to ``n`` of its unlocked units and says
        whether any went; the method calls it when its store runs short."""

    # -- step hooks --------------------------------------------------------------------------
    def prepare_step(self, step: StepInfo) -> None:
        """Once per forward, before the model runs."""

    def before_attention(self, layer: LayerInput) -> None:
        """Every layer of every step, before attention (KV of this step already written)."""

    def on_prefill_chunk(self, layer: LayerInput) -> None:
        """Every layer of a step with prefill tokens: the chunk's q/k/v (scoring, summaries)."""

    def prefix_kv(self, rid: str, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Prefill chunks: the request's history that the engine's slot table does not hold (a
        method store's tokens, e.g. KIVI's quantized blocks, dequantized), as K / V
        ``[n, H_kv, d]`` of logical positions ``[0, n)``; the chunk attends it, then its resident
        rows, then itself causally. None: the resident rows are the whole history."""
        return None

    def build_decode_selection(self, layer: LayerInput) -> DecodeView | None:
        """Every layer of a decode step: the rows attention reads. None: all resident rows."""
        return None

    def decode_view_tensors(self, batch: DecodeBatch) -> PagedDecodeView | None:
        """``graph_decode`` methods: every decode layer, after this step's KV is written. Tensor
        ops only (captured into CUDA graphs). None: dense attention over the resident rows."""
        return None

    def after_attention(self, layer: LayerInput, out: torch.Tensor) -> None:
        """Every layer of every step, with attention's output ``[T, H_q, d]``."""

    def on_layer_end(self, layer_id: int, step: StepInfo) -> None:
        """End of a layer: share state across layers (e.g. reuse a filter layer's selection)."""

    def finish_step(self, step: StepInfo) -> None:
        """Once per forward, after the model ran: update statistics, plan compactions."""

    def apply_pending(self, only: set[str] | None = None) -> int:
        """At the engine's safe point: apply planned physical changes, for the requests in
        ``only`` (None: all); the rest stay planned. Returns slots freed."""
        return 0

    def has_pending(self, rid: str) -> bool:
        """Whether a physical change is planned for ``rid`` and not applied yet."""
        return False

    def has_any_pending(self) -> bool:
        """Whether a physical change is planned for any request (the adapter waits for a step
        still in flight before the safe point applies it: SGLang's overlap scheduler)."""
        return False
