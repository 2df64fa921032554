"""Scheduler-side hooks that drive the SparseController once per forward step.

- AROUND ``TpModelWorker.forward_batch_generation`` (``around_forward``): translate the
  ScheduleBatch into a ``StepInfo`` (logical ranges per request), ``begin_step`` before the
  model runs, ``end_step`` after it.
- BEFORE ``ScheduleBatch.prepare_for_decode`` and ``Scheduler.get_new_batch_prefill``: the safe
  point (``apply_safe_point``; before a prefill also for the request between two prompt chunks,
  ``compact_chunked``). The previous step's results are processed (finished requests
  released; under the overlap scheduler not yet: below), nothing reads the KV, and the next
  slots are not allocated yet: planned compactions
  run here, and the batch's lengths follow the resident rows (``rows.follow_compaction``).
- BEFORE ``mem_cache.common.release_kv_cache`` (``before_release``): the request leaves
  (finished, aborted, retracted); its method state is dropped before SGLang frees its rows.

Physical eviction needs mixed chunks and the radix cache off (the launcher sees to it): a
compacted row inserted into the radix tree would be wrong. SGLang's overlap scheduler is off too
unless ``--sparse-overlap on``. Under it the scheduler prepares step k+1 (and reaches its safe
point) while step k still runs on the device and before step k's results are processed:

- ``inflight.wait_for_device`` first waits for step k when a compaction is due;
- a request that finished in step k may still be in the batch (its finish is seen one
  iteration later): compacting it is harmless, its release follows;
- lengths are patched on new tensors (``rows.set_row_lengths``): the queued copy of batch k
  keeps its own.
Without it the device is idle at the safe point and the wait returns at once.
"""

from __future__ import annotations

from sglang_sparse.core.events import RequestSlice, StepInfo, StepMode
from sglang_sparse.srt.chains import scheduler as chains
from sglang_sparse.srt.engine import probe, rows
from sglang_sparse.srt.engine.inflight import wait_for_device
from sglang_sparse.srt.prune import scheduler as prune
from sglang_sparse.srt.state import STATE, sparse


def token_ids(req, start: int, end: int, wanted: bool) -> tuple[int, ...]:
    """The request's token ids at logical ``[start, end)`` (prompt, then output), when the
    method reads tokens (``runtime.reads_tokens``); () otherwise."""
    if not wanted:
        return ()
    prompt = req.origin_input_ids
    n = len(prompt)
    return tuple(prompt[start: min(end, n)]) + tuple(req.output_ids[max(start - n, 0): max(end - n, 0)])


def prompt_len(req) -> int:
    """The logical prompt: SGLang's prompt less the tokens an engine probe leaves after it
    (engine/probe.py: the probe and the forced last prompt token, once they moved into it)."""
    return len(req.origin_input_ids) - sparse(req).hidden


def step_from_batch(batch, ctl) -> StepInfo | None:
    mode = batch.forward_mode
    if mode.is_idle() or not batch.reqs:
        return None
    slices, tokens = [], ctl.runtime.reads_tokens
    if mode.is_decode():
        # seq_lens counts resident rows incl. the token being decoded, which is written to row
        # seq_len-1; its logical position adds the request's evicted-token offset.
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist()):
            known = ctl.cache.requests.get(req.rid)
            offset = known.retained.offset if known is not None else 0
            start = seq_len - 1 + offset
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, start, start + 1, seq_len - 1,
                                       prompt_len(req), token_ids(req, start, start + 1, tokens)))
        kind = StepMode.DECODE
    elif mode.name in ("EXTEND", "MIXED"):  # speculative verify modes are not supported
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            # prefix counts resident rows; the request may have logical tokens without KV before
            # them (a resumed chain, a pruned radix path: engine/rows.py)
            start = prefix + rows.request_offset(req)
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, start, start + extend, prefix,
                                       prompt_len(req), token_ids(req, start, start + extend, tokens)))
        kind = StepMode.MIXED if mode.is_mixed() else StepMode.PREFILL
    else:
        return None
    return StepInfo(ctl.steps, kind, tuple(slices))


def around_forward(original, worker, batch=None, *args, **kwargs):
    st = STATE.scheduler
    ctl = st.controller
    step = step_from_batch(batch, ctl) if (ctl is not None and batch is not None) else None
    if step is None:
        return original(worker, batch, *args, **kwargs)
    for r, req in zip(step.requests, batch.reqs):
        known = ctl.cache.requests.get(r.rid)
        if known is not None and (known.req_row != r.req_row or r.logical_start == 0):
            ctl.request_finished(r.rid)  # retracted and re-admitted: start over
            known = None
        if known is None:
            resumed = chains.resumed_state(req) if r.logical_start else None
            if resumed is not None:  # + an engine probe's metadata (a KVzip continuation)
                retained, metadata = resumed
                metadata = {**metadata, **(probe.start_metadata(req, ctl.runtime) or {})}
                ctl.request_resumed(r.rid, r.req_row, r.prompt_len, retained, metadata)
            else:
                # rows [0, row_start) are resident; on a pruned radix path they stand for
                # logical_start > row_start tokens (engine/rows.py); on cached units (KIVI's
                # blocks in the radix tree) the request holds no rows of its prefix
                units, metadata = sparse(req).units, None
                if units and r.logical_start:
                    assert r.row_start == 0 and r.logical_start == len(units) * ctl.runtime.prefix_unit, (
                        r.rid, r.row_start, r.logical_start, len(units))
                    metadata = ctl.runtime.units_metadata(units)
                sparse(req).units = None
                metadata = probe.start_metadata(req, ctl.runtime) or metadata
                ctl.request_started(r.rid, r.req_row, r.prompt_len, cached_len=r.row_start,
                                    cached_logical=r.logical_start, metadata=metadata)
    ctl.begin_step(step)
    st.current_step = step
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        st.current_step = None
    if ctl.runtime.needs_engine_probe:
        probe.force_first_tokens(step, batch, result)
    ctl.end_step(step)
    return result


def apply_safe_point(batch) -> None:
    """Run planned compactions, then make ``batch``'s per-request lengths follow resident rows."""
    ctl = STATE.scheduler.controller
    if ctl is None or batch is None or not batch.reqs:
        return
    wait_for_device(ctl)
    if ctl.safe_point({req.rid for req in batch.reqs}) == 0:
        return
    # Compaction just gave rows back. SGLang stops trying to admit once an admission failed for
    # memory ("batch is full") and reopens only when a request leaves; rows freed by eviction
    # must reopen it too, or waiting requests sit idle beside free KV.
    batch.batch_is_full = False
    rows.follow_compaction(batch)


def before_prepare_for_decode(batch, *args, **kwargs):
    apply_safe_point(batch)
    return None


def before_new_prefill(scheduler, running_batch=None, *args, **kwargs):
    """Prefill has priority over decode: without this, a burst of long prompts would hold their
    full KV until the next decode step. Here the last prefill batch is already merged into the
    running batch and its results are processed."""
    apply_safe_point(running_batch)
    compact_chunked(scheduler, running_batch)
    chains.reclaim_for(scheduler, running_batch)
    return None


def compact_chunked(scheduler, running_batch=None) -> None:
    """The request between two of its prompt chunks (SGLang's ``chunked_req``, in no batch now:
    its last chunk ran and was processed, its next one is not scheduled yet) is at a safe point
    too: a compaction its method planned after that chunk (H2O with ``evict_prefill``) runs here,
    and its bookkeeping follows (``rows.follow_chunk_compaction``)."""
    ctl = STATE.scheduler.controller
    req = getattr(scheduler, "chunked_req", None)
    if ctl is None or req is None or req.rid not in ctl.cache.requests:
        return
    wait_for_device(ctl)
    if ctl.safe_point({req.rid}):
        rows.follow_chunk_compaction(req)
        if running_batch is not None:
            running_batch.batch_is_full = False  # freed rows reopen admission (apply_safe_point)


def before_release(req, tree_cache=None, *args, **kwargs):
    if getattr(tree_cache, "units_on", False) and STATE.scheduler.controller is not None \
            and req.rid in STATE.scheduler.controller.cache.requests:
        tree_cache.cache_units(req)  # the radix cache keeps its units (KIVI's blocks) first
    chains.before_release(req)  # park the chain's state while the controller still has it
    prune.on_release(req)
    ctl = STATE.scheduler.controller
    if ctl is not None:
        ctl.request_finished(req.rid)
    rows.on_release(req)
    return None
