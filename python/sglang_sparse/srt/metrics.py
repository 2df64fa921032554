"""Prometheus metrics of sglang_sparse, exported through SGLang's own ``/metrics``.

With ``--enable-metrics`` SGLang runs ``prometheus_client`` in multiprocess mode: every process
writes its samples under ``PROMETHEUS_MULTIPROC_DIR`` and the HTTP server's ``/metrics``
aggregates them. The scheduler refreshes its gauges and counters at most once per
``REFRESH_SECONDS`` (after a forward step, and when the scheduler goes idle), so scraping costs
the serving loop nothing; the main process updates the prune-job gauge when a job changes.

Names (all prefixed ``sglang_sparse:``; gauges summed over live schedulers):

| metric | type | labels | meaning |
|---|---|---|---|
| ``events_total`` | counter | method, event | the method's counters (``compactions``, ``slots_released``, ``admission_rows_saved``, ``pages_selected``, ...) |
| ``kv_slots`` | gauge | owner | KV slots by owner: ``free``, ``requests``, ``radix_tree``, ``chains`` |
| ``kv_bytes`` | gauge | owner | the same in bytes of the KV pool |
| ``host_bytes`` | gauge | kind | a method's host tier (RetroInfer): ``total`` capacity and ``used`` bytes (absent for one-tier methods) |
| ``kv_tokens`` | gauge | owner, kind | ``logical`` and ``retained`` tokens by owner (``/sparse/stats`` ``by_owner``) |
| ``chains`` | gauge | status | chains per status (``active``, ``idle``, ``reclaimed``, ``invalidated``) |
| ``integrity_lost_slots``, ``integrity_owned_twice_slots`` | gauge | | the last slot census (0 when healthy) |
| ``integrity_violations_total`` | counter | | failed censuses of ``SGLANG_SPARSE_CHECK_INTEGRITY=1`` |
| ``prune_jobs`` | gauge | status | ``/prune`` jobs per status (main process) |
"""

from __future__ import annotations

import time

from sglang_sparse.srt.state import STATE

PREFIX = "sglang_sparse:"
REFRESH_SECONDS = 1.0
OWNERS = ("requests", "radix_tree", "chains")
CHAIN_STATUSES = ("active", "idle", "reclaimed", "invalidated")
PRUNE_STATUSES = ("queued", "running", "completed", "blocked", "failed")


class SchedulerMetrics:
    """The scheduler's metric objects (created once prometheus_client may be imported)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.events = Counter(f"{PREFIX}events_total", "sparse-method counters", ["method", "event"])
        self.slots = Gauge(f"{PREFIX}kv_slots", "KV slots by owner", ["owner"], multiprocess_mode="livesum")
        self.bytes = Gauge(f"{PREFIX}kv_bytes", "KV pool bytes by owner", ["owner"], multiprocess_mode="livesum")
        self.tokens = Gauge(f"{PREFIX}kv_tokens", "logical and retained tokens by owner", ["owner", "kind"],
                            multiprocess_mode="livesum")
        self.host = Gauge(f"{PREFIX}host_bytes", "host-tier KV bytes", ["kind"], multiprocess_mode="livesum")
        self.chains = Gauge(f"{PREFIX}chains", "chains by status", ["status"], multiprocess_mode="livesum")
        self.lost = Gauge(f"{PREFIX}integrity_lost_slots", "slots without an owner at the last census",
                          multiprocess_mode="livesum")
        self.twice = Gauge(f"{PREFIX}integrity_owned_twice_slots", "slots with two owners at the last census",
                           multiprocess_mode="livesum")
        self.violations = Counter(f"{PREFIX}integrity_violations", "failed every-step censuses")
        self._seen: dict[tuple[str, str], int] = {}
        self._violations = 0
        self._last = 0.0
        self.dirty = True  # something changed since the last refresh

    def refresh(self, scheduler, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < REFRESH_SECONDS:
            return
        self._last, self.dirty = now, False
        from sglang_sparse.srt import status

        stats = status.scheduler_stats(scheduler)
        if stats is None:
            return
        for event, value in stats["counters"].items():
            if event == "integrity_violations":
                continue
            key = (stats["method"], event)
            delta = int(value) - self._seen.get(key, 0)
            child = self.events.labels(*key)  # exported from 0 on, before its first event
            if delta > 0:
                child.inc(delta)
            self._seen[key] = int(value)
        per_slot = STATE.scheduler.controller.cache.store.bytes_per_slot()
        census = stats["integrity"]
        slots = {"free": stats["kv_free_slots"], "requests": census["request_slots"],
                 "radix_tree": census["tree_slots"], "chains": census["chain_slots"]}
        for owner, n in slots.items():
            self.slots.labels(owner).set(n)
            self.bytes.labels(owner).set(n * per_slot)
        if "host_bytes_total" in stats:  # a method with a host tier
            self.host.labels("total").set(stats["host_bytes_total"])
            self.host.labels("used").set(stats["host_bytes_used"])
        for owner in OWNERS:
            for kind in ("logical", "retained"):
                self.tokens.labels(owner, kind).set(stats["by_owner"][owner][f"{kind}_tokens"])
        chains = stats.get("chains") or {}
        for status_name in CHAIN_STATUSES:
            self.chains.labels(status_name).set(chains.get(status_name, 0))
        self.lost.set(census["lost"])
        self.twice.set(census["owned_twice"])
        violations = STATE.scheduler.integrity_violations
        if violations > self._violations:
            self.violations.inc(violations - self._violations)
            self._violations = violations


def _metrics(scheduler) -> SchedulerMetrics | None:
    if not getattr(scheduler.server_args, "enable_metrics", False):
        return None
    if STATE.scheduler.metrics is None:
        STATE.scheduler.metrics = SchedulerMetrics()
    return STATE.scheduler.metrics


def after_process_batch_result(result, scheduler, *args, **kwargs):
    m = _metrics(scheduler)
    if m is not None:
        m.dirty = True
        m.refresh(scheduler)
    return None


def after_on_idle(result, scheduler, *args, **kwargs):
    """The last step's state is exported once the scheduler goes idle (it may sleep then)."""
    m = _metrics(scheduler)
    if m is not None and m.dirty:
        m.refresh(scheduler, force=True)
    return None


def mark_changed() -> None:
    """An admin operation changed the KV state between steps (chain deletion, a prune)."""
    if STATE.scheduler.metrics is not None:
        STATE.scheduler.metrics.dirty = True


# -- HTTP process: /prune jobs -----------------------------------------------------------------------
def prune_jobs_changed(records) -> None:
    """Set the prune-job gauge from the job records (main process; a no-op without metrics)."""
    from sglang.srt.entrypoints.http_server import get_global_state

    if not getattr(get_global_state().tokenizer_manager.server_args, "enable_metrics", False):
        return
    if STATE.http.prune_gauge is None:
        from prometheus_client import Gauge

        STATE.http.prune_gauge = Gauge(f"{PREFIX}prune_jobs", "/prune jobs by status", ["status"],
                                       multiprocess_mode="livesum")
    counts = {s: 0 for s in PRUNE_STATUSES}
    for rec in records:
        counts[rec.get("status")] = counts.get(rec.get("status"), 0) + 1
    for status, n in counts.items():
        STATE.http.prune_gauge.labels(status).set(n)
