"""The slot census: every KV slot of the pool has exactly one owner (scheduler process).

Owners (of whole pages when SGLang runs with ``--page-size`` > 1: a request's partly written
last page is its own): the allocator's free list; a radix-tree node (its retained slots); a
request's own rows ``[cache_protected_len, kv_allocated_len)`` (rows before ``cache_protected_len`` are tree
slots), wherever the scheduler holds it (``engine/held.py``); a chain's parked rows ``[0, rows)``
(idle, or resumed by a request still waiting for admission: the rows are lent to the request
only when it is admitted). The census runs on the scheduler's thread (between loop
steps or right after a batch result is processed), so what it reads does not move under it:
``ok: false`` is a real leak or double owner.

``SGLANG_SPARSE_CHECK_INTEGRITY=1`` runs it after every processed batch result; a violation is
logged with the census and counted (``integrity_violations`` in ``/sparse/stats``).
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.srt.chains import scheduler as chains
from sglang_sparse.srt.engine.held import scheduler_requests
from sglang_sparse.srt.state import STATE

logger = logging.getLogger("sglang_sparse")


def parked_spans() -> list:
    """(kv record, first row) of the rows chains hold (``chains.parked``)."""
    return [(rec.payload.kv, 0) for rec in chains.parked()]


def _rows(table, spans) -> list[torch.Tensor]:
    return [table[kv.req_pool_idx, start: kv.kv_allocated_len].to(torch.int64).cpu() for kv, start in spans]


def _page_slots(pages: torch.Tensor, page: int) -> torch.Tensor:
    """Every slot of ``pages`` (page ``p`` holds slots ``[p * page, (p + 1) * page)``)."""
    return (pages.view(-1, 1) * page + torch.arange(page)).flatten()


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
    free = _page_slots(free_pages, page)
    total = int(scheduler.max_total_num_tokens)
    if page > 1:  # a paged pool hands out whole pages: an owner of any row of a page owns all of it
        by_request, by_chain, by_tree = ([_page_slots(torch.unique(x // page), page) for x in xs]
                                         for xs in (by_request, by_chain, by_tree))
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
        STATE.scheduler.integrity_violations += 1
        logger.error("sglang_sparse: slot census failed after a step: %s", report)
    return None
