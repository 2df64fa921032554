"""The step still in flight under SGLang's overlap scheduler (``--sparse-overlap on``).

There the scheduler prepares step k+1, and reaches its safe point, while step k still runs on the
device (``engine/steps.py``). A compaction moves and frees rows that step k may read or write,
and rewrites RoPE offsets it may read: it first waits for the device. It then runs on the
scheduler's stream, which SGLang makes step k+1's forward wait for. Without the overlap
scheduler the device is idle at every safe point and the wait returns at once.
"""

from __future__ import annotations

import torch


def wait_for_device(ctl) -> None:
    """Before planned compactions are applied: wait for the step in flight (none pending: no wait)."""
    if ctl.runtime.has_any_pending() and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
