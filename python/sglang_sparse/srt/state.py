"""The one piece of mutable state of the SGLang adapter, typed (``STATE``), and the one attribute
sglang_sparse sets on SGLang objects: ``req.sparse`` (``ReqSparse``, via ``sparse(req)``).

``STATE.scheduler`` lives in each scheduler process (one model runner per process), built when
SGLang builds the attention backend (after the KV pool exists); ``STATE.http`` in the main
process. Spawned processes start from a fresh ``STATE``.
"""

from __future__ import annotations

import contextvars
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang_sparse.core.chain_index import ChainCacheIndex
from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.events import StepInfo
from sglang_sparse.srt.chains.records import Parked, ReqChain
from sglang_sparse.srt.prune.job import Job


@dataclass
class ReqSparse:
    """sglang_sparse's per-request state, ``req.sparse`` on SGLang's ``Req``."""

    chain: ReqChain | None = None  # the request's chain (Chain Cache on)
    park: Parked | None = None  # what the chain keeps once the request finishes (snapshot at release)
    # Rows vs logical positions (engine/rows.py): the request's resident rows stand for more
    # logical tokens than they are. ``gap`` is what a radix match found without KV (a pruned
    # path, N - P); ``start_offset`` what the first extend must apply (the gap, or a resumed
    # chain's N - P); ``offset`` the RoPE offset applied to its rows (None until the first extend).
    gap: int = 0
    start_offset: int = 0
    offset: int | None = None
    probe: Job | None = None  # this request is the scoring probe of a pruning job
    probe_cap: int | None = None  # ... whose prefix match stops here (snapkv policy)
    units: list | None = None  # cached method units its radix match starts on (KIVI's blocks)
    # engine probe (engine/probe.py): the prompt's last token, forced as the first decode input
    # until it moves from the output into the prompt; then ``hidden`` prompt tokens (the probe
    # and that token) lie after the request's logical prompt
    forced: int | None = None
    hidden: int = 0


def sparse(req) -> ReqSparse:
    """``req.sparse``, created on first use."""
    st = getattr(req, "sparse", None)
    if st is None:
        st = req.sparse = ReqSparse()
    return st


@dataclass
class SchedulerState:
    controller: SparseController | None = None
    current_step: StepInfo | None = None  # the forward step running now (None between steps)
    # Per req_to_token row: logical length minus resident rows (tokens without KV before them).
    # RoPE positions are ``row + pos_offset[row]`` (engine/rows.py).
    pos_offset: torch.Tensor | None = None
    offset_rows: set[int] = field(default_factory=set)  # rows whose pos_offset is not 0 (rows.set_offset)
    chains: ChainCacheIndex | None = None  # Chain Cache on
    chain_fingerprint: str = ""  # model + method + options: what a chain must match to resume
    prune_jobs: dict[str, Job] = field(default_factory=dict)  # planned pruning jobs by id
    probe_rows: dict[int, Job] = field(default_factory=dict)  # req_to_token rows of running probes
    refused_head: str | None = None  # the waiting queue's head at the last admission round
    integrity_violations: int = 0  # failed every-step censuses (cache/integrity.py)
    metrics: Any = None  # metrics.SchedulerMetrics once --enable-metrics is seen
    # per-layer-row methods: K and V of every layer in one tensor [2, layers, slots, H, D]
    # (engine/flat_pool.py); the pool's k_buffer[l] / v_buffer[l] are views of it
    flat_kv: torch.Tensor | None = None
    # methods with their own KV store: the pool bytes SGLang left them (engine/payload_pool.py)
    payload_budget_bytes: int | None = None
    # ``projects_kv`` methods: the factors and RoPE table the projection hook took from the
    # loaded model (engine/projection.py), handed to the runtime's ``bind_model``
    model_info: Any = None


@dataclass
class HttpState:
    prunes: dict[str, dict] = field(default_factory=dict)  # /prune job records (newest KEEP_RECORDS)
    prune_tasks: set = field(default_factory=set)  # running /prune coroutines (kept referenced)
    local_ids: Any = field(default_factory=lambda: itertools.count(1))
    prune_ids: Any = field(default_factory=lambda: itertools.count(1))  # /prune job ids (all DP ranks)
    prune_gauge: Any = None  # metrics' prune-job gauge
    inflight: dict[str, tuple[str, Any]] = field(default_factory=dict)  # chain id -> (rid, HTTP request)
    probe_hidden: dict[str, int] = field(default_factory=dict)  # rid -> engine-probe tokens (api/probe.py)
    # set by a streaming handler, read by the generator wrapper it runs (http/requests.py)
    refusal: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("sglang_sparse_refusal", default=None))
    # chain fields of the request a streaming OpenAI handler serves, by choice (chains/http.py)
    stream_chain: contextvars.ContextVar = field(
        default_factory=lambda: contextvars.ContextVar("sglang_sparse_stream_chain", default=None))


@dataclass
class ProcessState:
    loaded: bool = False  # the plugin ran in this process
    applied: list = field(default_factory=list)  # inventory entries applied here (plugin.py)
    scheduler: SchedulerState = field(default_factory=SchedulerState)
    http: HttpState = field(default_factory=HttpState)


STATE = ProcessState()
