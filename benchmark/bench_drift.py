"""Single-stream decode speed over a server's lifetime, one server at a time (sglang_sparse dense,
then plain SGLang): rules a slow-down that grows with the number of requests served in or out.

    python benchmark/bench_drift.py --requests 12
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import concurrent_decode, write_json  # noqa: E402

from sglang_sparse.default_model import ensure_default_model
from sglang_sparse.server_process import ServerProcess

VARIANTS = {"sglang_sparse": "sglang_sparse.launch_server", "sglang": "sglang.launch_server"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    flags = ["--model-path", str(ensure_default_model()), "--max-total-tokens", "16384", "--device", "cpu",
             "--log-level", "warning", "--sleep-on-idle"]
    runs = {}
    for name, module in VARIANTS.items():
        rng = random.Random(0)
        with ServerProcess(flags, module=module) as srv:
            runs[name] = [
                concurrent_decode(srv.base_url, [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)]],
                                  args.new_tokens)["decode_tok_s"]
                for _ in range(args.requests)
            ]
        first, last = runs[name][: len(runs[name]) // 2], runs[name][len(runs[name]) // 2 :]
        print(f"{name:<14} " + " ".join(f"{x:5.1f}" for x in runs[name])
              + f" | median first half {statistics.median(first):.1f}, second half {statistics.median(last):.1f}",
              flush=True)
    path = write_json("drift_cpu.json", {"command": "python " + " ".join(sys.argv), "settings": vars(args), "runs": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
