"""Planned compactions, applied at the engine's safe point (engine-agnostic).

An evicting method decides *what* to keep while a step runs (``finish_step``) and must not move
rows while a forward may still read them; ``EvictingRuntime`` keeps the list of requests with a
planned compaction and applies them in ``apply_pending`` (see ``runtime`` for the firing order).
A subclass implements ``plan(rid)``: the logical positions to keep, ``[B]`` (the same tokens in
every layer and head: rows are re-pointed, no KV moves), ``[layers, kv_heads, B]``
(one budget for every layer) or a list of ``[kv_heads, B_l]`` per layer (per-layer budgets);
or ``KeptRows``: the kept *row* indices ``[layers, kv_heads, B]`` (a method that selects among
its rows: no position -> row search); or None when nothing is to be dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sglang_sparse.core.runtime import SparseMethodRuntime


@dataclass(frozen=True)
class KeptRows:
    """A plan in rows: ``rows [layers, kv_heads, B]``, ascending per head, on any device."""

    rows: torch.Tensor


class EvictingRuntime(SparseMethodRuntime):
    evicts_kv = True
    # Requests one ``plan_many`` call plans together at a safe point (1: one by one). A method
    # whose plans batch over requests (R-KV, H2O) sets more: its decode evictions come in waves
    # (every request that reached its interval), and one plan per request costs each its own
    # kernel launches and host round trips.
    plan_batch = 1

    def wave_batch(self, rows_each: int) -> int:
        """``plan_batch`` for a method whose requests hold ``rows_each`` rows at a decode eviction.
        A batch's host work does not grow with its requests (``CacheManager.compact_rows_many``),
        so batches are as large as their scratch allows: 64K rows on CUDA (a batch's
        ``[R, layers, kv_heads, n]`` scores, ~75 MB each in fp32 for a 36-layer, 8-KV-head model),
        32K elsewhere (where the reference also gathers one layer's keys in fp32 at a time:
        ``[R, n, kv_heads, d]``, ~134 MB for that shape)."""
        rows = 65536 if self.cache.store.k_buffer(0).is_cuda else 32768
        return max(1, rows // rows_each)

    def __init__(self, cache, oracle=None) -> None:
        super().__init__(cache, oracle)
        self.pending: list[str] = []
        self.pending_decode: set[str] = set()  # pending ones planned at a decode token (stats only)

    def schedule(self, rid: str, decoding: bool = False) -> None:
        if rid not in self.pending:
            self.pending.append(rid)
        if decoding:
            self.pending_decode.add(rid)

    def schedule_over_budget(self, step, kept: int, slack: int, during_prefill: bool = False) -> None:
        """Online eviction's trigger (StreamingLLM, H2O, R-KV): plan a compaction for each
        request of ``step`` that holds more than ``kept`` rows, right after its last prompt chunk,
        then whenever ``slack`` rows have accumulated past ``kept``. A request still prefilling
        keeps its whole prompt, unless ``during_prefill``: then a prompt chunk that leaves it
        ``slack`` or more rows past ``kept`` is evicted too (at the safe point before the next
        chunk, which then attends the retained rows), so a request holds at most
        ``kept + slack - 1 + chunk`` rows while prefilling."""
        for r in step.requests:
            state = self.cache.requests.get(r.rid)
            prefilling = r.logical_end < r.prompt_len
            if state is None or (prefilling and not during_prefill):
                continue
            over = state.retained.n_rows - kept
            if over > 0 and (r.is_last_prompt_chunk or over >= slack):
                # a decode token: one new position past the prompt (a retracted request's
                # re-prefill and a prompt chunk are not)
                self.schedule(r.rid, decoding=r.num_tokens == 1 and not r.is_prefill)

    def plan(self, rid: str) -> torch.Tensor | list[torch.Tensor] | KeptRows | None:
        raise NotImplementedError

    def plan_many(self, rids: list[str]) -> list:
        """The plans of up to ``plan_batch`` requests at one safe point, in order (default: ``plan``
        each). Plans in rows of one shape are compacted together (``CacheManager.compact_rows_many``)."""
        return [self.plan(rid) for rid in rids]

    def by_row_count(self, rids: list[str], over: int) -> dict[int, list[int]]:
        """For a ``plan_many``: the indices into ``rids`` of the requests holding more than
        ``over`` rows, grouped by their row count (a group plans as one ``[R, ..., n]`` batch)."""
        groups: dict[int, list[int]] = {}
        for i, rid in enumerate(rids):
            n = self.cache.requests[rid].retained.n_rows
            if n > over:
                groups.setdefault(n, []).append(i)
        return groups

    def has_pending(self, rid: str) -> bool:
        return rid in self.pending

    def has_any_pending(self) -> bool:
        return bool(self.pending)

    def apply_pending(self, only: set[str] | None = None) -> int:
        """Compact the pending requests (those in ``only``; None: all). What it costs goes to
        ``timings_us["compaction"]``: host wall time of the plans and moves, so ``/sparse/stats``
        says what eviction costs a decode step (``timings_us.compaction / steps``). On a GPU that
        includes the plans' device work (their results are read on the host; the device is idle
        at the safe point, so nothing else is waited for) but not the KV moves, which run
        asynchronously (no synchronize on the serving path). The compactions of requests already
        decoding (planned at a decode token) are also counted apart,
        ``counters.decode_compactions`` and ``timings_us.compaction_decode``: prompt compressions
        and evictions between prompt chunks drop thousands of rows, a decode eviction ``interval``."""
        if not self.pending:
            return 0
        t0 = time.perf_counter()
        ready, waiting = [], []
        for rid in self.pending:
            if rid not in self.cache.requests:  # gone: finished before its safe point
                continue
            (waiting if only is not None and rid not in only else ready).append(rid)
        freed = 0
        # prompt compressions and decode evictions in batches of their own: their costs are
        # reported apart, and a batch then holds requests of about one size
        size = max(1, self.plan_batch)
        for decoding in (False, True):
            group = [rid for rid in ready if (rid in self.pending_decode) == decoding]
            for i in range(0, len(group), size):
                batch = group[i: i + size]
                t = time.perf_counter()
                got = self._compact(batch, self.plan_many(batch))
                freed += sum(got)
                done = sum(1 for g in got if g)
                if done and decoding:
                    self.bump("decode_compactions", done)
                    self.add_time("compaction_decode", time.perf_counter() - t)
        self.pending = waiting
        self.pending_decode.intersection_update(waiting)
        if freed:
            self.add_time("compaction", time.perf_counter() - t0)
        return freed

    def _compact(self, rids: list[str], plans: list) -> list[int]:
        """Slots freed per request: plans in rows of one shape together, the rest one by one."""
        got = [0] * len(rids)
        rows = [i for i, p in enumerate(plans) if isinstance(p, KeptRows)]
        together = len(rows) > 1 and len({tuple(plans[i].rows.shape) for i in rows}) == 1
        if together:  # counted in cache.counters, as compact_rows
            freed = self.cache.compact_rows_many([rids[i] for i in rows], torch.stack([plans[i].rows for i in rows]))
            for i, g in zip(rows, freed):
                got[i] = g
        for i, (rid, keep) in enumerate(zip(rids, plans)):
            if isinstance(keep, KeptRows):
                if not together:
                    got[i] = self.cache.compact_rows(rid, keep.rows)
            elif keep is not None:
                got[i] = self.cache.compact(rid, keep)
        return got
