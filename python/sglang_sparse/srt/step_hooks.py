"""Scheduler-side hooks that drive the SparseController once per forward step.

- AROUND ``TpModelWorker.forward_batch_generation``: translate the ScheduleBatch into a
  ``StepInfo`` (logical ranges per request), ``begin_step`` before the model runs, ``end_step`` and
  the safe point after it.
- BEFORE ``mem_cache.common.release_kv_cache``: the request leaves (finished, aborted, retracted);
  its method state is dropped before SGLang frees its rows.
"""

from __future__ import annotations

from sglang_sparse.core.events import RequestSlice, StepInfo, StepMode
from sglang_sparse.srt import state

FORWARD_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
RELEASE_TARGET = "sglang.srt.mem_cache.common.release_kv_cache"


def step_from_batch(batch, step_id: int) -> StepInfo | None:
    mode = batch.forward_mode
    if mode.is_idle() or not batch.reqs:
        return None
    slices = []
    if mode.is_decode():
        # seq_lens already counts the token being decoded: it sits at logical position seq_len-1.
        for req, seq_len in zip(batch.reqs, batch.seq_lens_cpu.tolist()):
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, seq_len - 1, seq_len, seq_len - 1,
                                       len(req.origin_input_ids)))
        kind = StepMode.DECODE
    elif mode.name in ("EXTEND", "MIXED"):  # speculative verify modes are not supported
        for req, prefix, extend in zip(batch.reqs, batch.prefix_lens, batch.extend_lens):
            slices.append(RequestSlice(req.rid, req.kv.req_pool_idx, prefix, prefix + extend, prefix,
                                       len(req.origin_input_ids)))
        kind = StepMode.MIXED if mode.is_mixed() else StepMode.PREFILL
    else:
        return None
    return StepInfo(step_id, kind, tuple(slices))


def around_forward(original, worker, batch=None, *args, **kwargs):
    ctl = state.controller
    step = step_from_batch(batch, ctl.steps) if (ctl is not None and batch is not None) else None
    if step is None:
        return original(worker, batch, *args, **kwargs)
    for r in step.requests:
        known = ctl.cache.requests.get(r.rid)
        if known is not None and (known.req_row != r.req_row or r.logical_start == 0):
            ctl.request_finished(r.rid)  # retracted and re-admitted: start over
            known = None
        if known is None:
            ctl.request_started(r.rid, r.req_row, r.prompt_len, cached_len=r.logical_start)
    ctl.begin_step(step)
    state.current_step = step
    try:
        result = original(worker, batch, *args, **kwargs)
    finally:
        state.current_step = None
    ctl.end_step(step)
    ctl.safe_point()
    return result


def before_release(req, *args, **kwargs):
    if state.controller is not None:
        state.controller.request_finished(req.rid)
    return None


def register() -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(FORWARD_TARGET, around_forward, HookType.AROUND)
    HookRegistry.register(RELEASE_TARGET, before_release, HookType.BEFORE)
    return ["hook:forward-step", "hook:release-kv"]
