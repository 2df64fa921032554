"""What the dense path through sglang_sparse adds to every forward step, timed in isolation.

Runs the scheduler-side step hook (``srt.step_hooks.around_forward``) around a no-op "forward"
on a synthetic decode batch of B requests with the dense runtime, and reports the added
microseconds per step. Wall-clock A/B runs of whole servers on a shared 2-core machine swing by
±15% per repetition (see bench_overhead.py); this isolates the extension's own cost.

    python benchmark/bench_hook_cost.py --batch 1 8 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_json  # noqa: E402

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.kv_store import TensorKVStore
from sglang_sparse.methods.dense import DenseRuntime
from sglang_sparse.srt import state, step_hooks


class DecodeMode:
    name = "DECODE"

    def is_idle(self):
        return False

    def is_decode(self):
        return True


def fake_batch(b: int, seq_len: int = 300):
    reqs = [SimpleNamespace(rid=f"r{i}", kv=SimpleNamespace(req_pool_idx=i), origin_input_ids=[0] * 256)
            for i in range(b)]
    return SimpleNamespace(forward_mode=DecodeMode(), reqs=reqs,
                           seq_lens_cpu=torch.full((b,), seq_len, dtype=torch.int64))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args()
    rows = {}
    for b in args.batch:
        state.controller = SparseController(DenseRuntime(CacheManager(TensorKVStore(1, 8, 1, 1, max_rows=b), 1)))
        batch = fake_batch(b)
        noop = lambda worker, batch: None  # noqa: E731
        for _ in range(50):
            step_hooks.around_forward(noop, None, batch)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step_hooks.around_forward(noop, None, batch)
        hooked = (time.perf_counter() - t0) / args.steps
        t0 = time.perf_counter()
        for _ in range(args.steps):
            noop(None, batch)
        bare = (time.perf_counter() - t0) / args.steps
        rows[b] = {"added_us_per_step": 1e6 * (hooked - bare)}
        print(f"batch {b:>3}: +{rows[b]['added_us_per_step']:.1f} us per forward step", flush=True)
    path = write_json("hook_cost_cpu.json", {"command": "python " + " ".join(sys.argv), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
