"""Chain Cache inside SGLang's scheduler (``docs/chain_cache.md``; the HTTP side is
``chains/http.py``).

A request names its chain with ``sampling_params.custom_params.chain_id`` (the one per-request
field SGLang carries to the scheduler; the main process moves a top-level ``chain_id`` there);
without one it starts a chain. Its first output carries ``chain_id``, ``chain_status``
(created|resumed) and ``reused_tokens`` (SGLang's ``customized_info``, key ``INFO_KEY``).

Life of a chain's KV (``core.chain_index`` holds the records; ``cache/radix.py`` calls in):

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
  the record; the match says N = processed logical tokens, so SGLang prefills only ``[N, len)``;
  its P rows stand for N tokens (``req.sparse.start_offset = N - P``, ``engine/rows.py``).
- an aborted, cancelled or retracted request invalidates its chain (an abort at once, when it
  arrives); idle chains are reclaimed least recently used when a waiting request does not fit
  (``reclaim_for``); a continuation the server can never take (its tokens reach SGLang's maximum
  input length, or its rows + suffix + output exceed the pool) gets 400 and the chain stays idle.

SGLang sessions (``/open_session``, ``session_params``) are chains named ``session-<id>``.
Admin operations on chains are ``admin/ops.ChainDelete`` (``delete``).
"""

from __future__ import annotations

import copy
from http import HTTPStatus

from sglang_sparse.core.chain_index import CHAIN_KEY
from sglang_sparse.core.chain_index import chain_id_prefix as make_prefix
from sglang_sparse.core.chain_index import (ChainBusy, ChainCacheIndex, ChainError, ChainStatus,
                                             ContinuationTooLarge, fingerprint, key_chain_id, session_chain_id)
from sglang_sparse.srt.chains.records import Parked, Pinned, ReqChain
from sglang_sparse.srt.engine import probe as engine_probe
from sglang_sparse.srt.engine.admission import store_claims
from sglang_sparse.srt.engine.held import scheduler_requests
from sglang_sparse.srt.engine.inflight import wait_for_device
from sglang_sparse.srt.prune.job import PROBE_KEY
from sglang_sparse.srt.state import STATE, sparse

INFO_KEY = "sglang_sparse_chain"  # customized_info key of the chain fields (read by chains/http.py)
PROBE_INFO = "probe_tokens"  # in those fields: a resumed request's engine-probe tokens (not shown)


def setup(model_runner, config: dict) -> None:
    """Create this scheduler's index (called with the controller)."""
    if not config.get("chain_cache"):
        return
    store = STATE.scheduler.controller.cache.store
    prefix = chain_id_prefix(config.get("chain_replica"))
    STATE.scheduler.chains = ChainCacheIndex(lambda p: _free_payload(store, p), id_prefix=prefix)
    model = getattr(model_runner.server_args, "model_path", "") or ""
    STATE.scheduler.chain_fingerprint = fingerprint(str(model), config.get("method", "dense"), config.get("options") or {})


def chain_id_prefix(replica: str | None = None) -> str:
    """``chain-`` on one scheduler; ``chain-r<k>-`` on data-parallel rank k of several, so ids are
    unique across ranks and a continuation can be routed to the rank that holds its chain
    (``api/generate.py``, ``core.chain_index.dp_rank_of``); ``--chain-replica NAME`` puts the
    server's name in front (``chain-NAME-...``) so ids are unique across replicas too."""
    from sglang_sparse.srt.parallel import dp_ranks

    rank, ranks = dp_ranks()
    return make_prefix(replica, rank if ranks > 1 else None)


def _free_payload(store, payload) -> None:
    if isinstance(payload, Pinned):
        payload.cache.tree.unlock(payload.node)
        return
    STATE.scheduler.controller.runtime.release_parked(payload.metadata)  # e.g. KIVI's blocks
    payload.metadata = {}
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
    idx = STATE.scheduler.chains
    if idx is None or req is None or req.to_finish is not None:
        return None
    params = req.sampling_params.custom_params
    if isinstance(params, dict) and PROBE_KEY in params:
        return None  # a pruning probe belongs to no chain
    if req.sampling_params.max_new_tokens == 0:
        return None  # SGLang's prefix warm-up before parallel samples (n > 1): no chain of its own
    chain_id = params.get("chain_id") if isinstance(params, dict) else None
    key = params.get(CHAIN_KEY) if isinstance(params, dict) else None
    session = getattr(req, "session", None)
    probe_len = None
    try:
        if chain_id is None and session is not None:
            sparse(req).chain = _session_chain(idx, session_chain_id(session.session_id), req, scheduler)
        elif chain_id is None and isinstance(key, str):
            sparse(req).chain = _keyed_chain(idx, key_chain_id(key), req, scheduler)
        elif chain_id is None:
            sparse(req).chain = ReqChain(idx.start(STATE.scheduler.chain_fingerprint).chain_id, "created", 0)
        else:
            rec = idx.check_continuation(str(chain_id), STATE.scheduler.chain_fingerprint, list(req.origin_input_ids))
            ctl = STATE.scheduler.controller
            probe_len = engine_probe.rebase(req, rec.boundary, scheduler, ctl.runtime)  # KVzip
            _check_length(scheduler, rec, req)
            _check_capacity(scheduler, rec, req)
            tokens = list(req.origin_input_ids)  # (a probe after the context: the prefix checked is the same)
            rec = idx.resume(str(chain_id), STATE.scheduler.chain_fingerprint, tokens)  # checks again: cheap
            sparse(req).chain = ReqChain(rec.chain_id, "resumed", _reused(rec), rec.payload)
    except ChainError as err:
        engine_probe.drop(req)
        req.set_finish_with_abort(err.message, status_code=HTTPStatus(err.status), err_type=type(err).__name__)
        if isinstance(err, ContinuationTooLarge):
            # SGLang's own length check runs after this hook and would put its sentence (which
            # suggests --allow-auto-truncate, wrong for a chain) in place of ours; the aborted
            # request's 1-token prefill needs no more than its first token
            req.origin_input_ids = req.origin_input_ids[:1]  # (same type: SGLang adds output_ids to it)
        # SGLang finishes an aborted request through a 1-token prefill, admitted like any other:
        # its output reservation must not keep it waiting (a 503 is about exactly that)
        req.sampling_params.max_new_tokens = 1
        return None
    ch = sparse(req).chain
    info = {"chain_id": ch.chain_id, "chain_status": ch.status, "reused_tokens": ch.reused}
    if ch.status == "resumed" and probe_len is not None:
        info[PROBE_INFO] = probe_len  # the HTTP process subtracts it from prompt_tokens (not shown)
    req.customized_info = {**(req.customized_info or {}), INFO_KEY: [info]}
    return None


def _reused(rec) -> int:
    """Logical tokens a continuation takes from the chain: its processed boundary, or for a
    pinned full-KV chain what the tree holds of it (whole KV pages)."""
    return min(rec.boundary, rec.payload.tokens) if isinstance(rec.payload, Pinned) else rec.boundary


def _check_length(scheduler, rec, req) -> None:
    """400 for a continuation longer than SGLang takes in one request (``max_req_input_len``,
    from the context length and the pool): its logical tokens are the chain's history + the new
    suffix, even though only the chain's kept rows are resident (the positions and SGLang's
    request row are logical). Checked here, before SGLang's own length check aborts it with the
    chain already lent, so the chain stays idle and usable."""
    limit = getattr(scheduler, "max_req_input_len", None)
    n = len(req.origin_input_ids)
    if limit is not None and n >= int(limit):
        raise ContinuationTooLarge(
            f"input_ids: the continuation of chain {rec.chain_id} has {n} tokens ({rec.boundary} from the chain, "
            f"{n - rec.boundary} new) and this server takes fewer than {int(limit)} per request (its context "
            f"length and KV pool); the chain stays idle: send a shorter suffix or start a new chain")


def _check_capacity(scheduler, rec, req) -> None:
    """400 for a continuation the KV pool can never hold (its chain's rows + the new suffix + the
    output it asks for), even with every other chain reclaimed; the chain stays idle."""
    need = rec.rows + len(req.origin_input_ids) - rec.boundary + (req.sampling_params.max_new_tokens or 0)
    total = int(scheduler.max_total_num_tokens)
    if need > total:
        raise ContinuationTooLarge(f"input_ids, max_new_tokens: chain {rec.chain_id}: the continuation needs {need} KV slots ({rec.rows} kept, "
                              f"{len(req.origin_input_ids) - rec.boundary} new, {req.sampling_params.max_new_tokens} "
                              f"to generate) and the pool has {total}")


def _keyed_chain(idx: ChainCacheIndex, cid: str, req, scheduler) -> ReqChain:
    """A routing key's chain: like a session's (resumed when the request extends it, started over
    when it does not), except that a key's chain in use by another request does not refuse this
    one: it runs on a chain of its own (``chain-<n>``), as a request without the key would."""
    rec = idx.chains.get(cid)
    if rec is not None and rec.status is ChainStatus.ACTIVE:
        return ReqChain(idx.start(STATE.scheduler.chain_fingerprint).chain_id, "created", 0)
    return _session_chain(idx, cid, req, scheduler)


def _session_chain(idx: ChainCacheIndex, cid: str, req, scheduler) -> ReqChain:
    """An SGLang session is a chain named after it. SGLang builds a session request as the
    previous prompt + output + new input, which extends the chain; when it does not (``offset``,
    ``replace``, ``drop_previous_output``) the session's chain starts over, as a plain session
    would re-prefill."""
    rec = idx.chains.get(cid)
    if rec is not None and rec.status is ChainStatus.IDLE:
        _check_length(scheduler, rec, req)  # 400 before the chain is lent (SGLang checks later)
        try:
            rec = idx.resume(cid, STATE.scheduler.chain_fingerprint, list(req.origin_input_ids))
            return ReqChain(cid, "resumed", _reused(rec), rec.payload)
        except ChainError:
            pass
    if rec is not None and rec.status is ChainStatus.ACTIVE:
        raise ChainBusy(f"chain {cid} is in use by another request of the session")
    if rec is not None:
        idx.delete(cid)
    return ReqChain(idx.start(STATE.scheduler.chain_fingerprint, chain_id=cid).chain_id, "created", 0)


def after_close_session(result, scheduler, recv_req, *args, **kwargs):
    """Closing a session drops its chain (an active one is invalidated: its request frees its rows)."""
    cid = session_chain_id(recv_req.session_id)
    if STATE.scheduler.chains is None or cid not in STATE.scheduler.chains.chains:
        return None
    if STATE.scheduler.chains.chains[cid].status is ChainStatus.ACTIVE:
        STATE.scheduler.chains.invalidate(cid, "its session was closed")
    else:
        STATE.scheduler.chains.delete(cid)
    return None


# -- prefix match: lend the parked rows ------------------------------------------------------------
def lend_match(params):
    """Called first by ``SparseRadixCache.match_prefix``: a resumed chain with parked rows gets
    them lent (a MatchResult of N logical tokens on a virtual node); anything else -> None."""
    req = getattr(params, "req", None)
    if req is None:
        return None
    st = sparse(req)
    ch = st.chain
    if ch is None or not isinstance(ch.lent, Parked) or st.offset is not None:
        return None  # not a resumed parked chain, or its first extend already ran
    from sglang.srt.mem_cache.base_prefix_cache import MatchResult
    from sglang.srt.session.streaming_session import _VirtualNode

    if req.kv is not ch.lent.kv:
        req.kv = ch.lent.kv  # the request owns the rows from now on (freed by SGLang if it aborts)
        rec = STATE.scheduler.chains.chains.get(ch.chain_id)
        if rec is not None and rec.payload is ch.lent:
            rec.payload, rec.rows = None, 0
    st.start_offset = ch.reused - ch.lent.retained.n_rows  # N - P (engine/rows.py)
    node = _VirtualNode()
    return MatchResult(device_prefix_len=ch.reused, last_device_node=node, last_host_node=node,
                       best_match_node=node, cache_protected_len=0)


def resumed_state(req):
    """(retained map, metadata) a request resumes with, or None (see engine/steps.around_forward)."""
    ch = sparse(req).chain
    if ch is None or not isinstance(ch.lent, Parked):
        return None
    return copy.deepcopy(ch.lent.retained), ch.lent.metadata


# -- the request leaves: park, or invalidate ---------------------------------------------------------
def before_release(req) -> None:
    """Called by engine/steps.before_release while the controller still knows the request."""
    ch, idx = sparse(req).chain, STATE.scheduler.chains
    if ch is None or idx is None:
        return
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    rec = idx.chains.get(ch.chain_id)
    if rec is None or rec.status is not ChainStatus.ACTIVE:
        return  # already invalidated (e.g. retracted earlier): nothing to keep
    known = STATE.scheduler.controller.cache.requests.get(req.rid)
    if req.finished() and not isinstance(req.finished_reason, FINISH_ABORT) and known is not None:
        settle_before_park(req)
        sparse(req).park = Parked(None, copy.deepcopy(known.retained), dict(known.metadata))
        STATE.scheduler.controller.runtime.on_request_parked(req.rid)  # its method store goes too
    else:  # cancelled, failed or retracted: the request's own release frees its rows
        idx.invalidate(ch.chain_id, "aborted" if req.finished() else "preempted")


def settle_before_park(req) -> None:
    """A compaction planned in the request's last step (SnapKV's after the prompt of a one-token
    answer, KIVI's quantization of its prompt) would be dropped with the request, and the chain
    would park every row at full size. Apply it now, at the request's own safe point (it runs no
    more forwards):

    ```
    rows  0 ........... P-1 | P .. A-1        P = retained rows, A = kv_allocated_len
          the request's KV    slots of sampled tokens that never ran (no KV): freed first
    ```
    then the compaction keeps P' <= P rows and frees the rest; the request owns rows ``[0, P')``
    (as after any compaction), which ``park_row`` parks."""
    ctl = STATE.scheduler.controller
    if not ctl.runtime.has_pending(req.rid):
        return
    trim_rows(req, ctl.cache.requests[req.rid].retained.n_rows)
    wait_for_device(ctl)  # under the overlap scheduler a step with this request may be in flight
    ctl.safe_point({req.rid})  # frees the dropped rows' slots itself
    req.kv.kv_allocated_len = req.kv.kv_committed_len = ctl.cache.requests[req.rid].retained.n_rows


def trim_rows(req, rows: int) -> None:
    """The finished request owns rows ``[0, rows)``: slots allocated past them (for sampled tokens
    that never ran, so hold no KV) go back to SGLang's allocator."""
    store = STATE.scheduler.controller.cache.store
    allocated = req.kv.kv_allocated_len
    if allocated > rows:
        store.free_slots(store.row_slots(req.kv.req_pool_idx, rows, allocated).clone())
    req.kv.kv_allocated_len = req.kv.kv_committed_len = rows


def before_release_aborted(scheduler, req, *args, **kwargs):
    """A request aborted before it ran (cancelled in the waiting queue, refused at arrival):
    its chain must not stay ACTIVE. If admission already lent it the parked rows, they are the
    request's and are freed here (SGLang frees KV only for requests that ran); otherwise the
    chain's payload is still in the index and goes with the invalidation."""
    ch, idx = sparse(req).chain, STATE.scheduler.chains
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

        lent = isinstance(ch.lent, Parked) and req.kv is ch.lent.kv  # the rows were lent to it
        release_kv_cache(req, scheduler.tree_cache, checkpoint=False)  # runs before_release
        if lent:  # never attached to the controller: what its metadata owns goes too (KIVI's blocks)
            STATE.scheduler.controller.runtime.release_parked(ch.lent.metadata)
            ch.lent.metadata = {}
    idx.invalidate(ch.chain_id, "cancelled before it ran")
    return None


def after_abort_request(result, scheduler, recv_req, *args, **kwargs):
    """An abort of a request on a chain (a cancelled client, ``/abort_request``) invalidates the
    chain at once: the request itself finishes one step later and frees its rows then, but a
    retry already queued behind the abort must find the chain gone (410), not busy (409)."""
    idx = STATE.scheduler.chains
    if idx is None:
        return None
    for req in scheduler_requests(scheduler):
        ch = sparse(req).chain
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
    park = sparse(req).park
    if park is None:
        return False
    if cache.tree_on:
        return False  # SGLang inserts the KV into the tree; on_release pins the path
    sparse(req).park = None
    rows = park.retained.n_rows
    trim_rows(req, rows)
    park.kv = req.detach_kv()
    tokens = engine_probe.logical_tokens(req)[: park.retained.logical_len]
    STATE.scheduler.chains.park(sparse(req).chain.chain_id, tokens, park, rows)
    return True


def pin_path(cache, req) -> None:
    """``SparseRadixCache.on_release`` (tree on): the finished chain request's KV is in the tree
    now, ending at ``req.last_node``; pin that path as the chain's payload."""
    park = sparse(req).park
    sparse(req).park = None
    if park is None or STATE.scheduler.chains is None:
        return
    node = req.last_node
    cache.tree.lock(node)
    path = cache.tree.path(node)
    retained = sum(n.retained for n in path)
    tokens = engine_probe.logical_tokens(req)[: park.retained.logical_len]
    pinned = Pinned(cache, node, retained, sum(len(n.key) for n in path))
    STATE.scheduler.chains.park(sparse(req).chain.chain_id, tokens, pinned, retained)


def parked() -> list:
    """Chain records whose parked rows the chain still holds: idle chains, and chains resumed by
    a request that has not been admitted yet (the rows are lent to it only at admission)."""
    if STATE.scheduler.chains is None:
        return []
    return [rec for rec in STATE.scheduler.chains.chains.values()
            if isinstance(rec.payload, Parked) and rec.payload.kv is not None and rec.payload.kv.holds_kv]


def parked_records() -> dict:
    """Parked rows, reported to SGLang's leak checks as session-held (``session_records``)."""
    return {f"{INFO_KEY}:{rec.chain_id}": rec.payload.kv for rec in parked()}


def reclaim_for(scheduler, running_batch=None) -> None:
    """Before admission: free idle chains, least recently used first (active chains are never
    touched), when the first waiting request cannot fit: by the arithmetic (prompt + decode
    reserve against free slots, a free req_to_token row; or a method store that cannot hold it, one
    chain per round, as idle chains may hold that store's units), or because nothing runs and it is still
    first in line after a scheduling round (SGLang's admission keeps margins of its own; one more
    chain per round)."""
    idx = STATE.scheduler.chains
    if idx is None or not scheduler.waiting_queue or not idx.idle_rows():
        return
    # (a request refused at arrival is admitted too, for its one-token abort; it asks for 1 token)
    req = scheduler.waiting_queue[0]
    prompt = len(req.origin_input_ids)
    need = prompt + 1 + STATE.scheduler.controller.oracle.decode_reserve(prompt, req.sampling_params.max_new_tokens or 0)
    # free slots plus unpinned radix-cached slots (SGLang evicts those itself when it allocates)
    free = STATE.scheduler.controller.cache.store.free_count() + int(scheduler.tree_cache.evictable_size())
    ctl = STATE.scheduler.controller
    if free < need or scheduler.req_to_token_pool.available_size() < 1:
        idx.reclaim(max(need - free, 1))
    elif ctl.store_admission and not ctl.runtime.store_admits(
            prompt, req.sampling_params.max_new_tokens or 0,
            store_claims(running_batch.reqs if running_batch is not None else [])):
        idx.reclaim(1)  # a method store (KIVI's blocks) is short: idle chains hold some of it
    elif ((running_batch is None or running_batch.is_empty()) and getattr(scheduler, "chunked_req", None) is None
          and STATE.scheduler.refused_head == req.rid):
        idx.reclaim(1)  # the same request was first in line last round too, and nothing runs
    STATE.scheduler.refused_head = req.rid


# -- admin ---------------------------------------------------------------------------------------
def delete(chain_id: str) -> dict:
    """``DELETE /chain/{id}``: drop a chain no request is using and free its rows."""
    idx = STATE.scheduler.chains
    if idx is None:
        raise ChainError("chain cache is off")
    rec = idx.get(chain_id)
    rows = rec.rows
    idx.delete(rec.chain_id)
    return {"status": 200, "deleted": rec.chain_id, "freed_rows": rows}
