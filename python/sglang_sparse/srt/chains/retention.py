"""The retention map in the scheduler, where the retained maps live (``core/retention``; the HTTP
side is ``srt/status.py``, the round trip ``admin/ops.ChainRetention`` / ``RequestRetention``).

What each owner of KV answers (logical positions ``[0, logical_len)``; ``retained_rows``: the
engine rows it holds):

- a running request: ``runtime.kept_positions`` of its map and metadata (``logical_len``: tokens
  that went through the model so far);
- a parked chain (methods that evict): the same over the parked map and metadata
  (``logical_len`` = the processed boundary);
- a pinned chain (full-KV methods, radix tree on): the positions its tree path retains (every
  one, unless ``/prune`` pruned the path), the same in every layer and head; ``logical_len`` is
  the boundary (the tree holds whole pages of it, so a tail may show as not kept);
- an active chain: its running request's map, or the parked map a resumed request has not been
  lent yet, or nothing (a new chain whose request has not started);
- a reclaimed or invalidated chain keeps no KV: 410.
"""

from __future__ import annotations

import torch

from sglang_sparse.core.chain_index import ChainError, ChainGone, ChainStatus
from sglang_sparse.core.retention import check_layers, describe
from sglang_sparse.srt.chains.records import Parked, Pinned
from sglang_sparse.srt.engine.held import scheduler_requests
from sglang_sparse.srt.state import STATE, sparse
from sglang_sparse.validation import RequestError, show


def _controller():
    ctl = STATE.scheduler.controller
    if ctl is None:
        raise RequestError("", "no sparse method runs in this scheduler, so it keeps no retention map", status=409)
    return ctl


def _answer(ctl, positions: list, logical_len: int, op, head: dict) -> dict:
    try:
        layers = check_layers(op.layers, len(positions))
    except ValueError as err:
        raise RequestError("layers", f"layers: {err}") from None
    return {**head, "method": ctl.runtime.name, **describe(positions, logical_len, layers, op.positions)}


def _request_map(ctl, state) -> tuple[list, int]:
    return ctl.runtime.kept_positions(state.retained, state.metadata), state.retained.logical_len


def of_request(scheduler, op) -> dict:
    """``GET /sparse/requests/{rid}/retention``."""
    ctl = _controller()
    state = ctl.cache.requests.get(op.rid)
    if state is None:
        if any(req.rid == op.rid for req in scheduler_requests(scheduler)):
            raise RequestError("rid", f"request {show(op.rid)} is still waiting and holds no KV yet", status=409)
        raise RequestError("rid", f"no running request has rid {show(op.rid)} (it finished, or never existed)",
                           status=404)
    positions, logical = _request_map(ctl, state)
    return _answer(ctl, positions, logical, op, {"rid": op.rid, "retained_rows": state.retained.n_rows})


def _pinned_positions(ctl, payload: Pinned) -> list:
    """A pinned tree path's retained positions, the same in every layer and KV head."""
    kept = payload.cache.tree.path_slots(payload.node)[1].to(torch.int64)
    return [kept.expand(ctl.cache.kv_heads, -1) for _ in range(ctl.cache.store.num_layers)]


def _running_on(scheduler, ctl, chain_id: str):
    """(rid, state) of the request that runs on an active chain and has KV, or None."""
    for req in scheduler_requests(scheduler):
        ch = sparse(req).chain
        if ch is not None and ch.chain_id == chain_id and req.rid in ctl.cache.requests:
            return req.rid, ctl.cache.requests[req.rid]
    return None


def of_chain(scheduler, op) -> dict:
    """``GET /chain/{id}/retention``."""
    idx = STATE.scheduler.chains
    if idx is None:
        raise ChainError("chain cache is off")
    ctl = _controller()
    rec = idx.get(op.chain_id)  # 404 for an unknown chain
    if rec.status in (ChainStatus.RECLAIMED, ChainStatus.INVALIDATED):
        raise ChainGone(f"chain {rec.chain_id} was {rec.status.value} ({rec.reason}) and keeps no KV")
    head = {"chain_id": rec.chain_id, "status": rec.status.value, "processed_tokens": rec.boundary,
            "retained_rows": rec.rows}
    running = _running_on(scheduler, ctl, rec.chain_id) if rec.status is ChainStatus.ACTIVE else None
    if running is not None:
        rid, state = running
        positions, logical = _request_map(ctl, state)
        head.update(rid=rid, retained_rows=state.retained.n_rows)
    elif isinstance(rec.payload, Parked) and rec.payload.kv is not None:
        positions = ctl.runtime.kept_positions(rec.payload.retained, rec.payload.metadata)
        logical = rec.payload.retained.logical_len
    elif isinstance(rec.payload, Pinned):
        positions, logical = _pinned_positions(ctl, rec.payload), rec.boundary
    else:  # a new chain whose request has not run yet
        positions = [torch.zeros(ctl.cache.kv_heads, 0, dtype=torch.int64)] * ctl.cache.store.num_layers
        logical = 0
    return _answer(ctl, positions, logical, op, head)
