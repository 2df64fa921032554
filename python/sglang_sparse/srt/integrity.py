"""The slot census: every KV slot of the pool has exactly one owner (scheduler process).

Owners: the allocator's free list; a radix-tree node (its retained slots); a request's own rows
``[cache_protected_len, kv_allocated_len)`` (rows before ``cache_protected_len`` are tree
slots); a chain's parked rows ``[0, rows)`` (idle, or resumed by a request still waiting for
admission: the rows are lent to the request only when it is admitted). A request counts wherever the scheduler holds
it, not only in the running batch: SGLang runs a prefill batch, processes its result and merges
it into the running batch one loop iteration later, and with the overlap scheduler one more
batch is in flight (``result_queue``). The census runs on the scheduler's thread (between loop
steps or right after a batch result is processed), so what it reads does not move under it:
``ok: false`` is a real leak or double owner.

``SGLANG_SPARSE_CHECK_INTEGRITY=1`` runs it after every processed batch result; a violation is
logged with the census and counted (``integrity_violations`` in ``/sparse/stats``).
"""

from __future__ import annotations

import logging
import os

import torch

from sglang_sparse.srt import state

logger = logging.getLogger("sglang_sparse")

ENV_EVERY_STEP = "SGLANG_SPARSE_CHECK_INTEGRITY"
PROCESS_RESULT_TARGET = "sglang.srt.managers.scheduler.Scheduler.process_batch_result"


def scheduler_requests(scheduler) -> list:
    """Every request the scheduler holds, once: running, the last and in-flight batches, the
    chunked request, and the waiting queue (a request may hold rows there, e.g. a chain's lent
    rows when admission did not go through)."""
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


def parked_spans() -> list:
    """(kv record, first row) of the rows chains hold (``chains.parked``)."""
    from sglang_sparse.srt import chains

    return [(rec.payload.kv, 0) for rec in chains.parked()]


def _rows(table, spans) -> list[torch.Tensor]:
    return [table[kv.req_pool_idx, start: kv.kv_allocated_len].to(torch.int64).cpu() for kv, start in spans]


def check_integrity(scheduler) -> dict:
    """The census (see module docstring), with the slots each kind of owner holds."""
    alloc = scheduler.token_to_kv_pool_allocator
    table = scheduler.req_to_token_pool.req_to_token
    problems = []
    by_request = _rows(table, [(r.kv, r.kv.cache_protected_len)
                               for r in scheduler_requests(scheduler) if r.kv.holds_kv])
    by_chain = _rows(table, parked_spans())
    by_tree = []
    tree = getattr(scheduler.tree_cache, "tree", None)
    if tree is not None:
        try:
            by_tree.append(tree.check())
        except AssertionError as err:
            problems.append(f"radix tree: {err}")
    page = alloc.page_size
    free_pages = alloc.get_all_free_pages().to(torch.int64).cpu()
    free = (free_pages.view(-1, 1) * page + torch.arange(page)).flatten()
    total = int(scheduler.max_total_num_tokens)
    owned = by_request + by_chain + by_tree
    # page 0 (slot 0, the padding slot, and the rest of its page) is never allocated
    counts = torch.bincount(torch.cat(owned + [free]), minlength=total + page)[page: total + page]
    twice, lost = int((counts > 1).sum()), int((counts == 0).sum())
    size = lambda xs: int(sum(x.numel() for x in xs))  # noqa: E731
    return {"ok": twice == 0 and lost == 0 and not problems, "owned_twice": twice, "lost": lost,
            "free": int(free.numel()), "owned": size(owned), "problems": problems,
            "request_slots": size(by_request), "chain_slots": size(by_chain), "tree_slots": size(by_tree)}


def after_process_batch_result(result, scheduler, *args, **kwargs):
    """Debug mode: the census after every processed batch result."""
    report = check_integrity(scheduler)
    if not report["ok"]:
        state.integrity_violations += 1
        logger.error("sglang_sparse: slot census failed after a step: %s", report)
    return None


def every_step() -> bool:
    return os.environ.get(ENV_EVERY_STEP, "") not in ("", "0")


def register() -> list[str]:
    if not every_step():
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PROCESS_RESULT_TARGET, after_process_batch_result, HookType.AFTER)
    return ["hook:integrity-every-step"]
