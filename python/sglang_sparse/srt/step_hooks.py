"""Scheduler-side hooks that drive the SparseController once per forward step.

- AROUND ``TpModelWorker.forward_batch_generation``: translate the ScheduleBatch into a
  ``StepInfo`` (logical ranges per request), ``begin_step`` before the model runs, ``end_step``
  after it.
- BEFORE ``ScheduleBatch.prepare_for_decode`` and ``Scheduler.get_new_batch_prefill``: the safe
  point. The previous step's results are processed (finished requests released), nothing reads
  the KV, and the next slots are not allocated yet: planned compactions run here, and SGLang's
  per-request lengths follow the resident rows (``seq_lens`` = rows, the logical rest goes to
  ``state.pos_offset``).
- BEFORE ``ModelRunner.forward``: decode RoPE positions get the evicted-token offset (eager and
  CUDA-graph replay alike: SGLang's graph runner copies ``forward_batch.positions`` into its
  buffers after this point).
- BEFORE ``mem_cache.common.release_kv_cache``: the request leaves (finished, aborted, retracted);
  its method state is dropped before SGLang frees its rows ``[0, kv_allocated_len)``.

Physical eviction needs the overlap scheduler, mixed chunks and the radix cache off (the
launcher sees to it): compaction between an in-flight forward and its result, or a compacted row
inserted into the radix tree, would be wrong.
"""

from __future__ import annotations

from sglang_sparse.core.events import RequestSlice, StepInfo, StepMode
from sglang_sparse.srt import chains, prune, state

FORWARD_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
RELEASE_TARGET = "sglang.srt.mem_cache.common.release_kv_cache"
DECODE_TARGET = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
PREFILL_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_new_batch_prefill"
RUNNER_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"


def step_from_batch(batch, ctl) -> StepInfo | None:
    mode = batch.forward_mode
    if mode.is_idle() or not batch.reqs:
        return None
    slices = []
    if mode.is_decode():
        # seq_lens counts resident rows incl. the token being decoded, which is written to row
        # seq_len-1; its logical position adds the request's evicted-token offset.
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist()):
            known = ctl.cache.requests.get(req.rid)
            offset = known.retained.offset if known is not None else 0
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, seq_len - 1 + offset,
                                       seq_len + offset, seq_len - 1, len(req.origin_input_ids)))
        kind = StepMode.DECODE
    elif mode.name in ("EXTEND", "MIXED"):  # speculative verify modes are not supported
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            # prefix counts resident rows; a request resuming a chain has `sparse_offset` logical
            # tokens without KV before them (see chains.after_prepare_for_extend).
            off = getattr(req, "sparse_offset", 0)
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, prefix + off, prefix + off + extend,
                                       prefix, len(req.origin_input_ids)))
        kind = StepMode.MIXED if mode.is_mixed() else StepMode.PREFILL
    else:
        return None
    return StepInfo(ctl.steps, kind, tuple(slices))


def around_forward(original, worker, batch=None, *args, **kwargs):
    ctl = state.controller
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
            if resumed is not None:
                ctl.request_resumed(r.rid, r.req_row, r.prompt_len, *resumed)
            else:
                # rows [0, row_start) are resident; on a pruned radix path they stand for
                # logical_start > row_start tokens (srt/radix.py)
                ctl.request_started(r.rid, r.req_row, r.prompt_len, cached_len=r.row_start,
                                    cached_logical=r.logical_start)
    ctl.begin_step(step)
    state.current_step = step
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        state.current_step = None
    ctl.end_step(step)
    return result


def apply_safe_point(batch) -> None:
    """Run planned compactions, then make ``batch``'s per-request lengths follow resident rows."""
    ctl = state.controller
    if ctl is None or batch is None or not batch.reqs:
        return
    if ctl.safe_point({req.rid for req in batch.reqs}) == 0:
        return
    # Compaction just gave rows back. SGLang stops trying to admit once an admission failed for
    # memory ("batch is full") and reopens only when a request leaves; rows freed by eviction
    # must reopen it too, or waiting requests sit idle beside free KV.
    batch.batch_is_full = False
    seq_lens, seq_lens_cpu, orig = batch.seq_lens.clone(), batch.seq_lens_cpu.clone(), batch.orig_seq_lens.clone()
    for i, req in enumerate(batch.reqs):
        known = ctl.cache.requests.get(req.rid)
        if known is None or known.retained.n_rows == req.kv.kv_allocated_len:
            continue
        rows = known.retained.n_rows  # compacted: the request now owns rows [0, rows)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = rows
        seq_lens[i] = seq_lens_cpu[i] = orig[i] = rows
        state.pos_offset[req.kv.req_pool_idx] = known.retained.offset
    # New tensors, never in place: queued copies of the batch may share the old ones.
    batch.seq_lens, batch.seq_lens_cpu, batch.orig_seq_lens = seq_lens, seq_lens_cpu, orig
    batch.seq_lens_sum = None


def before_prepare_for_decode(batch, *args, **kwargs):
    apply_safe_point(batch)
    return None


def before_new_prefill(scheduler, running_batch=None, *args, **kwargs):
    """Prefill has priority over decode: without this, a burst of long prompts would hold their
    full KV until the next decode step. Here the last prefill batch is already merged into the
    running batch and its results are processed."""
    apply_safe_point(running_batch)
    chains.reclaim_for(scheduler, running_batch)
    return None


def before_model_forward(runner, forward_batch=None, *args, **kwargs):
    """Logical RoPE positions for rows whose earlier KV was evicted (see ``state.pos_offset``)."""
    if state.pos_offset is None or forward_batch is None:
        return None
    mode = forward_batch.forward_mode
    if mode.is_decode():
        offset = state.pos_offset[forward_batch.req_pool_indices]
    elif mode.is_extend() and forward_batch.extend_seq_lens is not None:
        # A request resuming a chain, or on a pruned radix path, prefills its suffix after
        # logical tokens without KV (chains.after_prepare_for_extend).
        offset = state.pos_offset[forward_batch.req_pool_indices].repeat_interleave(
            forward_batch.extend_seq_lens.to(state.pos_offset.device))
    else:
        return None
    forward_batch.positions = forward_batch.positions + offset.to(forward_batch.positions.dtype)
    return None


def before_release(req, *args, **kwargs):
    chains.before_release(req)  # park the chain's state while the controller still has it
    prune.on_release(req)
    if state.controller is not None:
        state.controller.request_finished(req.rid)
        if state.pos_offset is not None and req.kv.req_pool_idx is not None:
            state.pos_offset[req.kv.req_pool_idx] = 0
    return None


def register() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(FORWARD_TARGET, around_forward, HookType.AROUND)
    HookRegistry.register(RELEASE_TARGET, before_release, HookType.BEFORE)
    HookRegistry.register(DECODE_TARGET, before_prepare_for_decode, HookType.BEFORE)
    HookRegistry.register(PREFILL_TARGET, before_new_prefill, HookType.BEFORE)
    HookRegistry.register(RUNNER_TARGET, before_model_forward, HookType.BEFORE)
    HookRegistry.register(chains.EXTEND_TARGET, chains.after_prepare_for_extend, HookType.AFTER)
    return ["hook:forward-step", "hook:release-kv", "hook:decode-safe-point", "hook:prefill-safe-point",
            "hook:decode-positions", "hook:extend-rows"]
