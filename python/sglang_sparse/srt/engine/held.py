"""The requests an SGLang scheduler holds at a moment between its loop steps."""

from __future__ import annotations


def scheduler_requests(scheduler) -> list:
    """Every request the scheduler holds, once: running, the last and in-flight batches, the
    chunked request, and the waiting queue (a request may hold rows there, e.g. a chain's lent
    rows when admission did not go through). SGLang runs a prefill batch, processes its result
    and merges it into the running batch one loop iteration later, and with the overlap
    scheduler one more batch is in flight (``result_queue``)."""
    seen, out = set(), []
    groups = [scheduler.running_batch.reqs, getattr(scheduler, "waiting_queue", [])]
    for batch in (getattr(scheduler, "last_batch", None), getattr(scheduler, "cur_batch_for_debug", None)):
        if batch is not None:
            groups.append(batch.reqs)
    for batch, _ in getattr(scheduler, "result_queue", None) or ():
        groups.append(batch.reqs)
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        groups.append([chunked])
    for group in groups:
        for req in group:
            if id(req) not in seen:
                seen.add(id(req))
                out.append(req)
    return out
