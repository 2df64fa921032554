"""Decode throughput and KV residency of dense vs Quest vs SnapKV through the real server.

Decode throughput (the paper's protocol, appendix C.6, measured from the client): one discarded
workload, then for each concurrency c, c identical-length requests are streamed; after every
request has produced ``--warmup`` tokens, a window opens and closes when the first request reaches
``--warmup + --window`` tokens; throughput = tokens produced inside the window (all requests) /
window time. Timing happens only at the window's edges.

Residency: with one fixed KV pool, ``--residency-requests`` long requests are submitted at once
and ``/sparse/stats`` is polled; the peak number of requests resident together is reported.

    python benchmark/bench_methods.py                    # CPU defaults (short, see --help)
    python benchmark/bench_methods.py --prompt-len 4096 --concurrency 1 4 16
    # GPU, SmolLM2-shaped random weights, the same attention path for every method:
    python benchmark/bench_methods.py --model-path DIR --prompt-len 8150 --concurrency 1 4 16 \
        --out methods_h200.json -- --load-format dummy --attention-backend torch_native --disable-cuda-graph
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import stream_generate, write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess

METHODS = {
    "dense": [],
    "quest": ["--sparse-method", "quest", "--sparse-token-budget", "256"],
    "snapkv": ["--sparse-method", "snapkv", "--sparse-budget", "256", "--chain-cache", "off"],
}


def decode_window(base_url: str, c: int, prompt_len: int, warmup: int, window: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(prompt_len)] for _ in range(c)]
    out: list[list[float]] = [[] for _ in range(c)]
    def run(i: int) -> None:
        out[i] = stream_generate(base_url, prompts[i], warmup + window + 2)["times"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0 = max(ts[warmup - 1] for ts in out)  # everyone is past warm-up
    t1 = min(ts[warmup + window - 1] for ts in out)  # the first one leaves the window
    tokens = sum(sum(1 for x in ts if t0 < x <= t1) for ts in out)
    return {"decode_tok_s": tokens / (t1 - t0) if t1 > t0 else float("nan"), "window_tokens": tokens,
            "window_s": t1 - t0}


def residency(base_url: str, n: int, prompt_len: int, new: int) -> int:
    bodies = [{"input_ids": [1000 + (13 * i + j) % 20000 for j in range(prompt_len)],
               "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
              for i in range(n)]
    threads = [threading.Thread(target=requests.post, args=(base_url + "/generate",),
                                kwargs={"json": b, "timeout": 3600}) for b in bodies]
    for t in threads:
        t.start()
    peak = 0
    while any(t.is_alive() for t in threads):
        peak = max(peak, requests.get(base_url + "/sparse/stats", timeout=60).json()["running_requests"])
        time.sleep(0.2)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=list(METHODS))
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, nargs="*", default=[1, 4],
                    help="decode concurrencies; none: residency only")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--window", type=int, default=24)
    ap.add_argument("--residency-requests", type=int, default=12)
    ap.add_argument("--residency-pool", type=int, default=4096)
    ap.add_argument("--no-residency", action="store_true", help="skip the residency measurement")
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="methods_cpu.json")
    ap.add_argument("extra", nargs="*", help="extra SGLang flags for every server (after --)")
    args = ap.parse_args()
    common = (["--model-path", args.model_path] if args.model_path else []) + args.extra

    results: dict[str, dict] = {}
    new = args.warmup + args.window + 2
    pool = max(args.concurrency, default=1) * (args.prompt_len + new) + 1024
    for name in args.methods:
        res = {}
        if args.concurrency:
            flags = METHODS[name] + common + ["--max-total-tokens", str(pool), "--log-level", "warning"]
            with ServerProcess(flags) as srv:
                decode_window(srv.base_url, 1, 64, 2, 4, seed=0)  # discarded workload
                res = {f"decode_tok_s@{c}": decode_window(srv.base_url, c, args.prompt_len, args.warmup,
                                                          args.window, seed=c) for c in args.concurrency}
        if not args.no_residency:
            flags = METHODS[name] + common + ["--max-total-tokens", str(args.residency_pool), "--log-level", "warning"]
            with ServerProcess(flags) as srv:
                res["peak_resident"] = residency(srv.base_url, args.residency_requests, args.prompt_len, new)
        results[name] = res
        print(name, json.dumps(res), flush=True)

    print(f"\nprompt {args.prompt_len} tokens; decode tok/s in a {args.window}-token window after {args.warmup} warm-up tokens")
    cols = [f"decode_tok_s@{c}" for c in args.concurrency]
    print(f"{'method':<10}" + "".join(f"{c:>20}" for c in cols) + f"{'peak resident':>15}")
    for name, res in results.items():
        print(f"{name:<10}" + "".join(f"{res[c]['decode_tok_s']:>20.2f}" for c in cols) + f"{res.get('peak_resident', '-'):>15}")
    print(f"(residency: {args.residency_requests} requests of {args.prompt_len}+{new} tokens, "
          f"pool {args.residency_pool} slots; dense arithmetic allows {args.residency_pool // (args.prompt_len + new)})")
    path = write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                                 "settings": vars(args), "methods": METHODS, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
