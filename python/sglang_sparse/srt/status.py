"""What the extension reports, per process: configuration, applied patches, KV accounting.

- Scheduler side: ``add_scheduler_record`` (AFTER SGLang's internal-state readback) adds an
  ``sglang_sparse`` record (pid, process, the patches applied there, stats, chains) to every
  internal-state readback, so ``/server_info`` and ``/sparse/*`` show what runs *inside* each
  scheduler.
- HTTP side: ``GET /sparse/info`` (the launcher's record and each scheduler's), ``GET
  /sparse/stats`` (``scheduler_stats`` of each scheduler), ``GET /chain``, ``GET|DELETE
  /chain/{id}``, and the retention maps ``GET /chain/{id}/retention`` and ``GET
  /sparse/requests/{rid}/retention`` (built in the scheduler: ``chains/retention.py``).
"""

from __future__ import annotations

import multiprocessing
import os

from fastapi import Request  # the retention handlers' annotation (FastAPI resolves it by name)

from sglang_sparse import __version__
from sglang_sparse.srt import activation
from sglang_sparse.srt.admin import ops
from sglang_sparse.srt.admin.http import admin_route, call
from sglang_sparse.srt.state import STATE
from sglang_sparse.validation import RequestError, show


def process_record() -> dict:
    import sglang.srt.layers.rotary_embedding.base as rope_base

    return {
        "version": __version__,
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "registrations": [p.name for p in STATE.applied],
        "patches": [p.describe() for p in STATE.applied],
        "rope_plain_torch_path": bool(rope_base._is_mps),
    }


def scheduler_stats(scheduler) -> dict | None:
    """KV accounting of one scheduler plus its controller's view (None if no method runs)."""
    from sglang_sparse.srt.cache import integrity

    st = STATE.scheduler
    if st.controller is None:
        return None
    stats = st.controller.stats()
    owners = residency(scheduler)
    logical = sum(o["logical_tokens"] for o in owners.values())
    retained = sum(o["retained_tokens"] for o in owners.values())
    total, free = int(scheduler.max_total_num_tokens), int(scheduler.token_to_kv_pool_allocator.available_size())
    per_slot = st.controller.cache.store.bytes_per_slot()  # the engine pool's representation
    runtime = st.controller.runtime
    own_total, own_used = runtime.payload_bytes()  # a method-owned store (docs/kv_payload.md)
    per_token = runtime.payload_bytes_per_token()
    tiers = runtime.tier_stats()  # a host tier besides the device (RetroInfer); never in kv_bytes_*
    host = {} if tiers is None else {"host_bytes_total": tiers["host_bytes_total"],
                                     "host_bytes_used": tiers["host_bytes_used"], "tiers": tiers}
    from sglang_sparse.srt.parallel import dp_rank

    return {
        "method": stats["method"],
        "dp_rank": dp_rank(),  # this scheduler's data-parallel rank
        "kv_total_slots": total,
        "kv_free_slots": free,
        "kv_bytes_per_token": per_slot if per_token is None else round(per_token, 2),
        "kv_bytes_per_slot": per_slot,
        "kv_bytes_total": total * per_slot + own_total,
        "kv_bytes_used": (total - free) * per_slot + own_used,
        **host,
        # method state that is not KV (Palu's factors): reported apart, never in kv_bytes_*
        "method_static_bytes": runtime.static_bytes(),
        # everything resident: running requests, the radix tree, idle chains (split in by_owner)
        "logical_tokens": logical,
        "retained_tokens": retained,
        "compression_ratio": round(logical / retained, 3) if retained else None,
        "by_owner": owners,
        "running_requests": len(st.controller.cache.requests),
        "peak_running_requests": stats["peak_running_requests"],  # high-water mark since start
        "steps": stats["steps"],
        "counters": {**stats["counters"], "integrity_violations": st.integrity_violations},
        "timings_us": stats["timings_us"],  # the method's own host wall time (docs/operations.md)
        "radix": _radix_stats(scheduler.tree_cache),
        "integrity": integrity.check_integrity(scheduler),  # every KV slot has exactly one owner
        **_chain_stats(st.chains),
    }


def residency(scheduler) -> dict:
    """Logical tokens and retained tokens (tokens with KV) per owner, counted once each, as the
    slot census counts slots: a request owns what it computed itself (its rows past
    ``cache_protected_len``; the tokens of its radix-cached prefix belong to the tree); an idle
    chain owns its parked rows (``chains.parked``; a pinned full-KV chain owns nothing: its path is
    in the tree)."""
    from sglang_sparse.srt.chains import scheduler as chains
    from sglang_sparse.srt.engine.held import scheduler_requests
    from sglang_sparse.srt.state import sparse

    known = STATE.scheduler.controller.cache.requests
    req_logical = req_rows = 0
    for req in scheduler_requests(scheduler):
        rs = known.get(req.rid)
        if rs is None or not req.kv.holds_kv:
            continue
        in_tree = req.kv.cache_protected_len  # rows [0, protected) are tree slots
        req_rows += rs.retained.n_rows - in_tree
        req_logical += rs.retained.logical_len - in_tree - sparse(req).gap
    tree = getattr(scheduler.tree_cache, "tree", None)
    tree_logical = sum(len(n.key) for n in tree.nodes()) if tree is not None else 0
    tree_rows = tree.total_retained() if tree is not None else 0
    chain_logical = chain_rows = 0
    for rec in chains.parked():
        chain_logical += rec.boundary
        chain_rows += rec.rows
    return {"requests": {"logical_tokens": req_logical, "retained_tokens": req_rows},
            "radix_tree": {"logical_tokens": tree_logical, "retained_tokens": tree_rows},
            "chains": {"logical_tokens": chain_logical, "retained_tokens": chain_rows}}


def _radix_stats(cache) -> dict:
    """The logical radix tree (srt/radix.py): cached slots free to evict, slots locked by running
    requests or pinned chains, nodes."""
    tree = getattr(cache, "tree", None)
    if tree is None:
        return {"backend": type(cache).__name__}
    out = {"backend": "sglang_sparse", "enabled": cache.tree_on or cache.units_on, "evictable_slots": tree.evictable,
           "protected_slots": tree.protected, "nodes": sum(1 for _ in tree.nodes())}
    if cache.units_on:  # a method store's payload (KIVI's blocks), one unit = ``unit_tokens`` tokens
        per_token = STATE.scheduler.controller.runtime.payload_bytes_per_token() or 0
        out.update(unit_tokens=cache.unit, unit_bytes=int(round(per_token * cache.unit)),
                   evictable_units=tree.evictable_units, protected_units=tree.protected_units)
    return out


def _chain_stats(index) -> dict:
    """Chain Cache: chains per status and the KV rows idle chains hold (free + idle rows +
    running requests' rows == total)."""
    if index is None:
        return {}
    by_status: dict[str, int] = {}
    for rec in index.chains.values():
        by_status[rec.status.value] = by_status.get(rec.status.value, 0) + 1
    return {"chains": by_status, "chain_idle_rows": index.idle_rows()}


TP_FIELDS = ("kv_total_slots", "kv_free_slots", "logical_tokens", "retained_tokens", "running_requests", "steps")
TP_COUNTERS = ("compactions", "slots_released", "rows_released", "evictions", "decode_compactions")


def tp_agreement(stats: dict | None) -> dict | None:
    """Under ``--tp-size`` > 1: every tensor-parallel rank's figures (``TP_FIELDS``, the
    counters, the slot census, the chains) and whether their slot accounting agrees (all but the
    counters outside ``TP_COUNTERS``). Each rank runs the same
    scheduler on its own KV heads, so these must be equal; rank 0 alone answers HTTP, so the
    others' numbers come by one all-gather (every rank reads internal state together: SGLang
    broadcasts the request to the whole TP group)."""
    st = STATE.scheduler
    heads = st.controller.cache.heads if st.controller is not None else None
    if heads is None or heads.size == 1 or stats is None:
        return None
    mine = {**{k: stats[k] for k in TP_FIELDS}, "counters": stats["counters"],
            "integrity_ok": stats["integrity"]["ok"], "chains": stats.get("chains", {})}
    ranks = heads.gather_object(mine)
    # what must be equal: the slot accounting; other counters may be per-rank diagnostics (e.g.
    # Palu's reconstruction residual over this rank's heads)
    same = lambda r: ({k: r[k] for k in TP_FIELDS}, r["integrity_ok"], r["chains"],  # noqa: E731
                      {k: r["counters"].get(k) for k in TP_COUNTERS})
    return {"size": heads.size, "agree": all(same(r) == same(ranks[0]) for r in ranks), "ranks": ranks}


def add_scheduler_record(result, controller, *args, **kwargs):
    record = process_record()
    record["stats"] = scheduler_stats(controller.scheduler)
    tp = tp_agreement(record["stats"])
    if tp is not None:
        record["stats"]["tp"] = tp
    chains = STATE.scheduler.chains
    if chains is not None:
        record["chains"] = [rec.describe() for rec in chains.chains.values()]
    result.internal_state["sglang_sparse"] = record
    return result


async def sparse_info():
    """GET /sparse/info: the launcher's record, one record per scheduler (per DP rank), and every
    method and prefill policy this install can serve (``available``)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    import sglang_sparse.methods  # noqa: F401  (registers every method)
    from sglang_sparse.registry import catalog

    states = await get_global_state().tokenizer_manager.get_internal_state()
    return {
        "config": activation.load_config(),
        "available": catalog(),
        "launcher": process_record(),
        "schedulers": [s.get("sglang_sparse") for s in states],
    }


async def sparse_stats():
    """GET /sparse/stats: KV accounting and method counters of scheduler 0 (``per_rank`` all, in
    data-parallel rank order)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    states = await get_global_state().tokenizer_manager.get_internal_state()
    per_rank = [(s.get("sglang_sparse") or {}).get("stats") for s in states]
    per_rank.sort(key=lambda s: (s or {}).get("dp_rank", 0))  # readbacks arrive in any order
    return {**(per_rank[0] or {}), "per_rank": per_rank}


async def _chain_states() -> list[dict]:
    """The sglang_sparse record of every scheduler (one per data-parallel rank)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    states = await get_global_state().tokenizer_manager.get_internal_state()
    return [s.get("sglang_sparse") or {} for s in states]


async def list_chains():
    """GET /chain: every chain of every scheduler (status, processed tokens, retained rows, last
    use) and the slot census (``integrity``: no KV slot owned twice or lost; with several
    data-parallel ranks ``ok`` over all of them and ``per_rank`` each)."""
    records = await _chain_states()
    chains = [c for r in records for c in r.get("chains") or []]
    censuses = [(r.get("stats") or {}).get("integrity") for r in records]
    integrity = censuses[0] if len(censuses) == 1 else {
        "ok": all(bool(c and c.get("ok")) for c in censuses), "per_rank": censuses}
    return {"chains": chains, "integrity": integrity}


@admin_route
async def get_chain(chain_id: str):
    """GET /chain/{chain_id}: one chain, 404 if unknown."""
    for record in await _chain_states():
        for rec in record.get("chains") or []:
            if rec["chain_id"] == chain_id:
                return rec
    raise RequestError("chain_id", f"unknown chain {show(chain_id)}", status=404)


@admin_route
async def delete_chain(chain_id: str):
    """DELETE /chain/{chain_id}: drop a chain no request is using and free its rows."""
    return await call(ops.ChainDelete(chain_id))


RETENTION_FORMATS = ("ranges", "positions")


def _retention_query(request) -> dict:
    """``?layers=0,5`` (only those layers) and ``?format=ranges|positions`` (``positions``: plain
    lists besides the runs); anything else is a 400 that names the parameter."""
    q = request.query_params
    unknown = sorted(set(q) - {"layers", "format"})
    if unknown:
        raise RequestError(unknown[0], f"unknown query parameter {show(unknown[0])}; the retention map takes "
                                       "layers and format")
    layers = None
    if "layers" in q:
        try:
            layers = [int(x) for x in q["layers"].split(",")]
        except ValueError:
            raise RequestError("layers", "layers must be comma-separated layer indices such as 0,5; got "
                                         f"{show(q['layers'])}") from None
    fmt = q.get("format", "ranges")
    if fmt not in RETENTION_FORMATS:
        raise RequestError("format", f"format must be one of {', '.join(RETENTION_FORMATS)}; got {show(fmt)}")
    return {"layers": layers, "positions": fmt == "positions"}


@admin_route
async def chain_retention(chain_id: str, request: Request):
    """GET /chain/{chain_id}/retention: the logical positions the chain keeps, per layer and KV
    head (404 unknown, 410 reclaimed or invalidated)."""
    return await call(ops.ChainRetention(chain_id, **_retention_query(request)))


@admin_route
async def request_retention(rid: str, request: Request):
    """GET /sparse/requests/{rid}/retention: the same for a running request (404 once it finished)."""
    return await call(ops.RequestRetention(rid, **_retention_query(request)))
