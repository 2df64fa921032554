"""Chain Cache inside SGLang's scheduler (``docs/chain_cache.md``).

A request names its chain with a top-level ``chain_id`` (``/generate`` and the OpenAI endpoints)
or ``sampling_params.custom_params.chain_id`` (the one per-request field SGLang carries to the
scheduler; the top-level form is moved there in the main process); without one it starts a
chain. Every response's ``meta_info`` (and OpenAI ``usage``) gets ``chain_id``, ``chain_status``
(created|resumed) and ``reused_tokens``.

Life of a chain's KV (``core.chain_index`` holds the records; ``srt/radix.py`` calls in):

- **park** (methods that evict; ``SparseRadixCache.claim_kv_row``, the hook SGLang's streaming
  sessions use to keep a finished request's row): a normally finished request keeps its resident
  rows ``[0, P)`` (over-allocated rows past P are freed) and its req_to_token row; the record
  stores SGLang's ``ReqKvInfo``, the RetainedMap and the method metadata (snapshotted by
  ``before_release`` before the controller forgets the request). Parked rows are reported through
  ``session_records`` so SGLang's idle leak checks count them.
- **pin** (full-KV methods, radix tree on; ``SparseRadixCache.on_release``): the request's KV
  goes into the tree as usual and the chain holds a lock on that path; a continuation matches
  through the tree.
- **lend** (``SparseRadixCache.match_prefix``, first): a continuation of a parked chain borrows
  the record; the match says N = processed logical tokens, so SGLang prefills only ``[N, len)``.
- **rows vs logical** (AFTER ``ScheduleBatch.prepare_for_extend``; also for requests on a pruned
  radix path): SGLang writes the suffix slots at ``row[N:N+s]`` and counts N prefix rows; the
  request really holds P <= N rows, so the slots move to ``row[P:P+s]``, the batch lengths
  become rows, and ``state.pos_offset`` gets N - P (RoPE positions stay logical, see
  ``step_hooks.before_model_forward``).
- an aborted, cancelled or retracted request invalidates its chain; idle chains are reclaimed
  least recently used when a waiting request does not fit (``reclaim_for``); a continuation the
  pool can never hold gets 503.

Admin: ``GET /chain``, ``GET /chain/{id}``, ``DELETE /chain/{id}`` (``srt/status.py``; mutations
ride SGLang's dumper-control round trip, ``around_dumper_control``, shared with ``/prune``).
SGLang sessions (``/open_session``, ``session_params``) are chains named ``session-<id>``.
"""

from __future__ import annotations

import contextvars
import copy
from http import HTTPStatus
from dataclasses import dataclass
from typing import Any

from sglang_sparse.core.chain_index import (ChainBusy, ChainCacheIndex, ChainError, ChainStatus, NoChainCapacity,
                                             fingerprint)
from sglang_sparse.core.retained import RetainedMap
from sglang_sparse.srt import prune, state

CREATE_TARGET = "sglang.srt.managers.scheduler.Scheduler._create_generation_req"
EXTEND_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend"
META_TARGET = "sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info"
CONTROL_TARGET = "sglang.srt.managers.scheduler.Scheduler.handle_dumper_control"
CLOSE_SESSION_TARGET = "sglang.srt.managers.scheduler.Scheduler.close_session"
INFO_KEY = "sglang_sparse_chain"


@dataclass
class Parked:
    """A chain's payload: SGLang's KV record (req_to_token row + row count) and the method's
    view of those rows."""

    kv: Any
    retained: RetainedMap
    metadata: dict


@dataclass
class Pinned:
    """A full-KV chain's payload (radix tree on): a lock on the tree path that holds the chain's
    processed prefix, so the prefix is not evicted while the chain is idle. A continuation then
    matches through the tree like any request."""

    cache: Any
    node: Any
    retained: int
    tokens: int  # logical tokens of the pinned path (the boundary rounded down to KV pages)


@dataclass
class ReqChain:
    """What a request knows of its chain (``req.sparse_chain``)."""

    chain_id: str
    status: str  # "created" | "resumed"
    reused: int  # logical tokens taken from the chain (its processed boundary)
    lent: Parked | None = None  # the resumed payload, owned by the request once lent
    fixed: bool = False  # rows-vs-logical fix-up done for the first extend


def setup(model_runner, config: dict) -> None:
    """Create this scheduler's index (called with the controller)."""
    if not config.get("chain_cache"):
        return
    store = state.controller.cache.store
    state.chains = ChainCacheIndex(lambda p: _free_payload(store, p))
    model = getattr(model_runner.server_args, "model_path", "") or ""
    state.chain_fingerprint = fingerprint(str(model), config.get("method", "dense"), config.get("options") or {})


def _free_payload(store, payload) -> None:
    if isinstance(payload, Pinned):
        payload.cache.tree.unlock(payload.node)
        return
    kv = payload.kv
    if kv.req_pool_idx is None:
        return
    n = kv.kv_allocated_len
    if n:
        store.free_slots(store.row_slots(kv.req_pool_idx, 0, n).clone())
    store.req_pool.free_rows([kv.req_pool_idx])
    kv.req_pool_idx = None
    kv.kv_allocated_len = kv.kv_committed_len = 0


# -- arrival ---------------------------------------------------------------------------------------
def after_create_req(req, scheduler, recv_req, *args, **kwargs):
    idx = state.chains
    if idx is None or req is None or req.to_finish is not None:
        return None
    params = req.sampling_params.custom_params
    if isinstance(params, dict) and prune.PROBE_KEY in params:
        return None  # a pruning probe belongs to no chain
    if req.sampling_params.max_new_tokens == 0:
        return None  # SGLang's prefix warm-up before parallel samples (n > 1): no chain of its own
    chain_id = params.get("chain_id") if isinstance(params, dict) else None
    session = getattr(req, "session", None)
    try:
        if chain_id is None and session is not None:
            req.sparse_chain = _session_chain(idx, session, req)
        elif chain_id is None:
            req.sparse_chain = ReqChain(idx.start(state.chain_fingerprint).chain_id, "created", 0)
        else:
            tokens = list(req.origin_input_ids)
            _check_capacity(scheduler, idx.check_continuation(str(chain_id), state.chain_fingerprint, tokens), req)
            rec = idx.resume(str(chain_id), state.chain_fingerprint, tokens)  # checks again: cheap
            req.sparse_chain = ReqChain(rec.chain_id, "resumed", _reused(rec), rec.payload)
    except ChainError as err:
        req.set_finish_with_abort(err.message, status_code=HTTPStatus(err.status), err_type=type(err).__name__)
        # SGLang finishes an aborted request through a 1-token prefill, admitted like any other:
        # its output reservation must not keep it waiting (a 503 is about exactly that)
        req.sampling_params.max_new_tokens = 1
        return None
    ch = req.sparse_chain
    info = {"chain_id": ch.chain_id, "chain_status": ch.status, "reused_tokens": ch.reused}
    req.customized_info = {**(req.customized_info or {}), INFO_KEY: [info]}
    return None


def _reused(rec) -> int:
    """Logical tokens a continuation takes from the chain: its processed boundary, or for a
    pinned full-KV chain what the tree holds of it (whole KV pages)."""
    return min(rec.boundary, rec.payload.tokens) if isinstance(rec.payload, Pinned) else rec.boundary


def _check_capacity(scheduler, rec, req) -> None:
    """503 for a continuation the KV pool can never hold (its chain's rows + the new suffix + the
    output it asks for), even with every other chain reclaimed; the chain stays idle."""
    need = rec.rows + len(req.origin_input_ids) - rec.boundary + (req.sampling_params.max_new_tokens or 0)
    total = int(scheduler.max_total_num_tokens)
    if need > total:
        raise NoChainCapacity(f"chain {rec.chain_id}: the continuation needs {need} KV slots ({rec.rows} kept, "
                              f"{len(req.origin_input_ids) - rec.boundary} new, {req.sampling_params.max_new_tokens} "
                              f"to generate) and the pool has {total}")


def session_chain_id(session_id: str) -> str:
    return f"session-{session_id}"


def _session_chain(idx: ChainCacheIndex, session, req) -> ReqChain:
    """An SGLang session is a chain named after it. SGLang builds a session request as the
    previous prompt + output + new input, which extends the chain; when it does not (``offset``,
    ``replace``, ``drop_previous_output``) the session's chain starts over, as a plain session
    would re-prefill."""
    cid = session_chain_id(session.session_id)
    rec = idx.chains.get(cid)
    if rec is not None and rec.status is ChainStatus.IDLE:
        try:
            rec = idx.resume(cid, state.chain_fingerprint, list(req.origin_input_ids))
            return ReqChain(cid, "resumed", _reused(rec), rec.payload)
        except ChainError:
            pass
    if rec is not None and rec.status is ChainStatus.ACTIVE:
        raise ChainBusy(f"chain {cid} is in use by another request of the session")
    if rec is not None:
        idx.delete(cid)
    return ReqChain(idx.start(state.chain_fingerprint, chain_id=cid).chain_id, "created", 0)


def after_close_session(result, scheduler, recv_req, *args, **kwargs):
    """Closing a session drops its chain (an active one is invalidated: its request frees its rows)."""
    cid = session_chain_id(recv_req.session_id)
    if state.chains is None or cid not in state.chains.chains:
        return None
    if state.chains.chains[cid].status is ChainStatus.ACTIVE:
        state.chains.invalidate(cid, "its session was closed")
    else:
        state.chains.delete(cid)
    return None


# -- prefix match: lend the parked rows ------------------------------------------------------------
def lend_match(params):
    """Called first by ``SparseRadixCache.match_prefix``: a resumed chain with parked rows gets
    them lent (a MatchResult of N logical tokens on a virtual node); anything else -> None."""
    req = getattr(params, "req", None)
    ch = getattr(req, "sparse_chain", None)
    if ch is None or not isinstance(ch.lent, Parked) or ch.fixed:
        return None
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult
    from sglang.srt.session.streaming_session import _VirtualNode

    if req.kv is not ch.lent.kv:
        req.kv = ch.lent.kv  # the request owns the rows from now on (freed by SGLang if it aborts)
        rec = state.chains.chains.get(ch.chain_id)
        if rec is not None and rec.payload is ch.lent:
            rec.payload, rec.rows = None, 0
    node = _VirtualNode()
    return MatchResult(device_prefix_len=ch.reused, last_device_node=node, last_host_node=node,
                       best_match_node=node, cache_protected_len=0)


# -- rows vs logical after SGLang allocated the extend ---------------------------------------------
def after_prepare_for_extend(result, batch, *args, **kwargs):
    prune.bind_rows(batch)
    offsets = []
    for req in batch.reqs:
        ch = getattr(req, "sparse_chain", None)
        if ch is not None and isinstance(ch.lent, Parked) and not ch.fixed:
            ch.fixed = True
            req.sparse_offset = ch.reused - ch.lent.retained.n_rows
        elif getattr(req, "sparse_gap", 0) and not getattr(req, "sparse_offset", 0):
            req.sparse_offset = req.sparse_gap  # matched a pruned radix path (srt/radix.py)
        offsets.append(getattr(req, "sparse_offset", 0))
    if not any(offsets):
        return None
    table = batch.req_to_token_pool.req_to_token
    prefix = list(batch.prefix_lens)
    seq_lens, seq_cpu, orig = batch.seq_lens.clone(), batch.seq_lens_cpu.clone(), batch.orig_seq_lens.clone()
    for i, (req, off) in enumerate(zip(batch.reqs, offsets)):
        if not off:
            continue
        row, logical, s = req.kv.req_pool_idx, prefix[i], batch.extend_lens[i]
        rows = logical - off  # the request's resident rows before this extend
        table[row, rows : rows + s] = table[row, logical : logical + s].clone()
        prefix[i] = rows
        seq_lens[i] = seq_cpu[i] = orig[i] = rows + s
        req.kv.kv_allocated_len = req.kv.kv_committed_len = rows + s
        state.pos_offset[row] = off
    batch.prefix_lens = prefix
    batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens = seq_lens, seq_cpu, orig
    batch.seq_lens_sum = int(seq_cpu.sum())
    return None


def resumed_state(req):
    """(retained map, metadata) a request resumes with, or None (see step_hooks.around_forward)."""
    ch = getattr(req, "sparse_chain", None)
    if ch is None or not isinstance(ch.lent, Parked):
        return None
    return copy.deepcopy(ch.lent.retained), ch.lent.metadata


# -- the request leaves: park, or invalidate ---------------------------------------------------------
def before_release(req) -> None:
    """Called by step_hooks.before_release while the controller still knows the request."""
    ch, idx = getattr(req, "sparse_chain", None), state.chains
    req.sparse_offset = 0  # a retracted request that comes back prefills from scratch
    if ch is None or idx is None:
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rec = idx.chains.get(ch.chain_id)
    if rec is None or rec.status is not ChainStatus.ACTIVE:
        return  # already invalidated (e.g. retracted earlier): nothing to keep
    known = state.controller.cache.requests.get(req.rid)
    if req.finished() and not isinstance(req.finished_reason, FINISH_ABORT) and known is not None:
        req.sparse_park = Parked(None, copy.deepcopy(known.retained), dict(known.metadata))
    else:  # cancelled, failed or retracted: the request's own release frees its rows
        idx.invalidate(ch.chain_id, "aborted" if req.finished() else "preempted")


def before_release_aborted(scheduler, req, *args, **kwargs):
    """A request aborted before it ran (cancelled in the waiting queue, refused at arrival):
    its chain must not stay ACTIVE. If admission already lent it the parked rows, they are the
    request's and are freed here (SGLang frees KV only for requests that ran); otherwise the
    chain's payload is still in the index and goes with the invalidation."""
    ch, idx = getattr(req, "sparse_chain", None), state.chains
    if ch is None or idx is None:
        return None
    rec = idx.chains.get(ch.chain_id)
    if rec is None or rec.status is not ChainStatus.ACTIVE:
        return None
    running = req is getattr(scheduler, "chunked_req", None) or req in scheduler.running_batch.reqs
    if running:
        return None  # SGLang releases its KV next; before_release invalidates the chain
    if req.kv.holds_kv:
        from sglang.srt.mem_cache.common import release_kv_cache

        release_kv_cache(req, scheduler.tree_cache, checkpoint=False)  # runs before_release
    idx.invalidate(ch.chain_id, "cancelled before it ran")
    return None


def after_abort_request(result, scheduler, recv_req, *args, **kwargs):
    """An abort of a request on a chain (a cancelled client, ``/abort_request``) invalidates the
    chain at once: the request itself finishes one step later and frees its rows then, but a
    retry already queued behind the abort must find the chain gone (410), not busy (409)."""
    from sglang_sparse.srt.integrity import scheduler_requests

    idx = state.chains
    if idx is None:
        return None
    for req in scheduler_requests(scheduler):
        ch = getattr(req, "sparse_chain", None)
        if ch is None or req.finished():  # SGLang ignores aborts of finished requests: they park
            continue
        if recv_req.abort_all or req.rid.startswith(recv_req.rid):
            rec = idx.chains.get(ch.chain_id)
            if rec is not None and rec.status is ChainStatus.ACTIVE:
                idx.invalidate(ch.chain_id, "its request was aborted")
    return None


def park_row(cache, req) -> bool:
    """``SparseRadixCache.claim_kv_row``: keep a finished chain request's rows (radix tree off),
    or pin its radix path once SGLang has inserted it (tree on, see ``pin_path``)."""
    park = getattr(req, "sparse_park", None)
    if park is None:
        return False
    if cache.tree_on:
        return False  # SGLang inserts the KV into the tree; on_release pins the path
    req.sparse_park = None
    rows, store = park.retained.n_rows, state.controller.cache.store
    row, allocated = req.kv.req_pool_idx, req.kv.kv_allocated_len
    if allocated > rows:  # a slot allocated for a token that never ran
        store.free_slots(store.row_slots(row, rows, allocated).clone())
    req.kv.kv_allocated_len = req.kv.kv_committed_len = rows
    park.kv = req.detach_kv()
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[: park.retained.logical_len]
    state.chains.park(req.sparse_chain.chain_id, tokens, park, rows)
    return True


def pin_path(cache, req) -> None:
    """``SparseRadixCache.on_release`` (tree on): the finished chain request's KV is in the tree
    now, ending at ``req.last_node``; pin that path as the chain's payload."""
    park = getattr(req, "sparse_park", None)
    req.sparse_park = None
    if park is None or state.chains is None:
        return
    node = req.last_node
    cache.tree.lock(node)
    path = cache.tree.path(node)
    retained = sum(n.retained for n in path)
    tokens = (list(req.origin_input_ids) + list(req.output_ids))[: park.retained.logical_len]
    pinned = Pinned(cache, node, retained, sum(len(n.key) for n in path))
    state.chains.park(req.sparse_chain.chain_id, tokens, pinned, retained)


def parked() -> list:
    """Chain records whose parked rows the chain still holds: idle chains, and chains resumed by
    a request that has not been admitted yet (the rows are lent to it only at admission)."""
    if state.chains is None:
        return []
    return [rec for rec in state.chains.chains.values()
            if isinstance(rec.payload, Parked) and rec.payload.kv is not None and rec.payload.kv.holds_kv]


def parked_records() -> dict:
    """Parked rows, reported to SGLang's leak checks as session-held (``session_records``)."""
    return {f"{INFO_KEY}:{rec.chain_id}": rec.payload.kv for rec in parked()}


def reclaim_for(scheduler, running_batch=None) -> None:
    """Before admission: free idle chains, least recently used first (active chains are never
    touched), when the first waiting request cannot fit: by the arithmetic (prompt + decode
    reserve against free slots, a free req_to_token row), or because nothing runs and it is still
    first in line after a scheduling round (SGLang's admission keeps margins of its own; one more
    chain per round)."""
    idx = state.chains
    if idx is None or not scheduler.waiting_queue or not idx.idle_rows():
        return
    # (a request refused at arrival is admitted too, for its one-token abort; it asks for 1 token)
    req = scheduler.waiting_queue[0]
    prompt = len(req.origin_input_ids)
    need = prompt + 1 + state.controller.oracle.decode_reserve(prompt, req.sampling_params.max_new_tokens or 0)
    # free slots plus unpinned radix-cached slots (SGLang evicts those itself when it allocates)
    free = state.controller.cache.store.free_count() + int(scheduler.tree_cache.evictable_size())
    if free < need or scheduler.req_to_token_pool.available_size() < 1:
        idx.reclaim(max(need - free, 1))
    elif ((running_batch is None or running_batch.is_empty()) and getattr(scheduler, "chunked_req", None) is None
          and getattr(scheduler, "_sparse_refused_head", None) == req.rid):
        idx.reclaim(1)  # the same request was first in line last round too, and nothing runs
    scheduler._sparse_refused_head = req.rid


# -- admin ---------------------------------------------------------------------------------------
CONTROL_PREFIX = "sglang_sparse/"


def around_dumper_control(original, scheduler, recv_req, *args, **kwargs):
    """Admin mutations ride SGLang's dumper-control round trip (a request type every process
    already knows); only methods named ``sglang_sparse/...`` are taken."""
    method = getattr(recv_req, "method", "")
    if not method.startswith(CONTROL_PREFIX):
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    try:
        result = _control(scheduler, method[len(CONTROL_PREFIX):], recv_req.body or {})
        out = DumperControlReqOutput(success=True, response=[result])
    except (ChainError, prune.PruneError) as err:
        out = DumperControlReqOutput(success=True, response=[{"status": err.status, "message": err.message}])
    except Exception as err:  # reported to the caller; the scheduler goes on
        out = DumperControlReqOutput(success=False, response=[], error=repr(err))
    scheduler.ipc_channels.send_to_tokenizer.send_output(out, recv_req)
    from sglang_sparse.srt import metrics

    metrics.mark_changed()
    return None


def _control(scheduler, op: str, body: dict) -> dict:
    if op.startswith(("prune_", "prefix_")):
        return prune.control(scheduler, op, body)
    if state.chains is None:
        raise ChainError("chain cache is off")
    if op == "chain_delete":
        rec = state.chains.get(str(body.get("chain_id")))
        rows = rec.rows
        state.chains.delete(rec.chain_id)
        return {"status": 200, "deleted": rec.chain_id, "freed_rows": rows}
    raise ChainError(f"unknown control operation {op!r}")


# -- response --------------------------------------------------------------------------------------
def around_update_meta_info(original, manager, meta_info, state_, customized_info, index, *args, **kwargs):
    """Move the chain fields from SGLang's per-token customized info into ``meta_info``. The
    scheduler attaches them to a request's first output token; SGLang pads the other requests of
    a batch (and later tokens) with None."""
    out = original(manager, meta_info, state_, customized_info, index, *args, **kwargs)
    values = meta_info.pop(INFO_KEY, None)
    info = next((v for v in values if isinstance(v, dict)), None) if isinstance(values, list) else None
    if info is not None:
        meta_info.update(info)
    return out


def register_scheduler() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(CREATE_TARGET, after_create_req, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler._release_aborted_request",
                          before_release_aborted, HookType.BEFORE)
    HookRegistry.register(CLOSE_SESSION_TARGET, after_close_session, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.abort_request", after_abort_request,
                          HookType.AFTER)
    return ["hook:chain-arrival", "hook:chain-cancel-waiting", "hook:chain-sessions", "hook:chain-abort"]


# -- OpenAI `usage` (main process) ----------------------------------------------------------------
CHAIN_FIELDS = ("chain_id", "chain_status", "reused_tokens")
# The chain fields of the request a streaming handler is serving, by choice index: filled while
# its generator runs (an async generator runs in the context of the task that iterates it), read
# when the handler builds the final usage chunk.
_STREAM_CHAIN = contextvars.ContextVar("sglang_sparse_stream_chain", default=None)


def _fields(meta) -> dict:
    return {k: meta[k] for k in CHAIN_FIELDS if isinstance(meta, dict) and k in meta}


def allow_usage_fields() -> None:
    """Let OpenAI ``usage`` objects carry the chain fields: SGLang's ``UsageInfo`` ignores extra
    attributes, and the response models embed its schema, so both are rebuilt."""
    from sglang.srt.entrypoints.openai import protocol

    protocol.UsageInfo.model_config["extra"] = "allow"
    protocol.UsageInfo.model_rebuild(force=True)
    for name in ("ChatCompletionResponse", "CompletionResponse", "ChatCompletionStreamResponse",
                 "CompletionStreamResponse"):
        getattr(protocol, name).model_rebuild(force=True)


def _set_usage(usage, by_index: dict) -> None:
    """One choice: ``chain_id`` / ``chain_status`` / ``reused_tokens``. Several (``n > 1``, each
    its own chain): ``chains``, one entry per choice in index order."""
    if len(by_index) == 1:
        for k, v in next(iter(by_index.values())).items():
            setattr(usage, k, v)
    elif by_index:
        usage.chains = [{"index": i, **by_index[i]} for i in sorted(by_index)]


def around_generate_request(original, manager, obj, *args, **kwargs):
    outputs = original(manager, obj, *args, **kwargs)

    async def remember_chain():
        seen: dict = {}
        _STREAM_CHAIN.set(seen)
        async for out in outputs:
            for item in out if isinstance(out, list) else [out]:
                fields = _fields(item.get("meta_info") if isinstance(item, dict) else None)
                if fields:
                    seen[item.get("index", 0)] = fields
            yield out

    return remember_chain()


def after_response_usage(usage, responses, *args, **kwargs):
    by_index = {}
    for i, r in enumerate(responses):
        fields = _fields(r.get("meta_info"))
        if fields:
            by_index[r.get("index", i)] = fields
    _set_usage(usage, by_index)
    return None


def after_streaming_usage(usage, *args, **kwargs):
    _set_usage(usage, _STREAM_CHAIN.get() or {})
    return None


def register_main() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(META_TARGET, around_update_meta_info, HookType.AROUND)
    usage = "sglang.srt.entrypoints.openai.usage_processor.UsageProcessor"
    HookRegistry.register(f"{usage}.calculate_response_usage", after_response_usage, HookType.AFTER)
    HookRegistry.register(f"{usage}.calculate_streaming_usage", after_streaming_usage, HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
                          around_generate_request, HookType.AROUND)
    allow_usage_fields()
    return ["hook:chain-meta-info", "hook:chain-openai-usage"]
