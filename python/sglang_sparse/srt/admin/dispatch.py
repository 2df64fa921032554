"""Scheduler side of the admin operations (``admin/ops.py``): AROUND SGLang's
``Scheduler.handle_dumper_control``, an operation of ours runs here on the scheduler's thread
(between steps) and its result goes back on the same channel; any other dumper-control request
is SGLang's own."""

from __future__ import annotations

import logging
import types

from sglang_sparse.core.chain_index import ChainError
from sglang_sparse.srt import metrics
from sglang_sparse.srt.admin import ops
from sglang_sparse.srt.chains import retention
from sglang_sparse.srt.chains import scheduler as chains
from sglang_sparse.srt.prune import scheduler as prune
from sglang_sparse.validation import RequestError

logger = logging.getLogger("sglang_sparse")

HANDLERS = types.MappingProxyType({
    ops.ChainDelete: lambda scheduler, op: chains.delete(op.chain_id),
    ops.ChainRetention: retention.of_chain,
    ops.RequestRetention: retention.of_request,
    ops.PrunePlan: prune.plan,
    ops.PruneApply: prune.apply,
    ops.PruneForget: lambda scheduler, op: prune.forget(op),
    ops.PrefixInspect: prune.inspect,
    ops.PrefixPriority: prune.set_priority,
    ops.PrefixDelete: prune.delete_prefix,
})


def run(scheduler, op) -> dict:
    """One operation: its result, or ``{"status": code, "message": ..., "param": ...}`` for a
    refusal (``param``: the field a RequestError names)."""
    try:
        return HANDLERS[type(op)](scheduler, op)
    except (ChainError, prune.PruneError) as err:
        return {"status": err.status, "message": err.message}
    except RequestError as err:
        return {"status": err.status, "message": err.message, "param": err.field}


def around_dumper_control(original, scheduler, recv_req, *args, **kwargs):
    method = getattr(recv_req, "method", "") or ""
    if not method.startswith(ops.METHOD_PREFIX):
        return original(scheduler, recv_req, *args, **kwargs)
    from sglang.srt.managers.io_struct import DumperControlReqOutput

    try:
        out = DumperControlReqOutput(success=True, response=[run(scheduler, ops.decode(method, recv_req.body or {}))])
    except Exception as err:  # reported to the caller; the scheduler goes on
        logger.exception("sglang_sparse: admin operation %s failed", method)
        out = DumperControlReqOutput(success=False, response=[], error=repr(err))
    scheduler.ipc_channels.send_to_tokenizer.send_output(out, recv_req)
    metrics.mark_changed()
    return None
