"""Cost of the extension: ``python -m sglang_sparse.launch_server`` (dense) vs plain
``python -m sglang.launch_server``, same model and flags, in one run.

Both servers run at the same time with ``--sleep-on-idle`` (an idle SGLang scheduler otherwise
busy-polls a whole core), and are measured in alternation, A B B A A B ..., so machine drift hits
both alike: time to first token (streamed, single request) and decode tokens/s at 1 and 8
concurrent streams. Medians over repetitions are reported; the overhead is ``1 - sparse/plain``
for throughput and ``sparse/plain - 1`` for TTFT (positive = sglang_sparse is worse).

Plain SGLang runs with sglang_sparse installed; its plugin then only applies the CPU rotary fix
that any SGLang 0.5.23 needs on a CPU (see docs/architecture.md), and registers nothing else.

    python benchmark/bench_overhead.py                      # CPU, default model
    python benchmark/bench_overhead.py --reps 8 --new-tokens 128 -- --attention-backend triton
Arguments after ``--`` are extra SGLang flags given to both variants.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import concurrent_decode, stream_generate, tree_cpu_seconds, write_json  # noqa: E402

from sglang_sparse.default_model import ensure_default_model
from sglang_sparse.server_process import ServerProcess

VARIANTS = {"sglang": "sglang.launch_server", "sglang_sparse": "sglang_sparse.launch_server"}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Token ids from the ordinary-word range of the vocabulary; distinct per prompt (no radix hits).
    return [[rng.randrange(1000, 30000) for _ in range(length)] for _ in range(n)]


def measure(server: ServerProcess, args, seed: int) -> dict:
    base_url = server.base_url
    concurrent_decode(base_url, prompts(2, args.prompt_len, seed), 16)  # warm-up
    ttft = statistics.median(
        stream_generate(base_url, p, 1)["ttft"] for p in prompts(3, args.prompt_len, seed + 1)
    )
    out = {"ttft_s": ttft}
    for c in args.concurrency:
        cpu0 = tree_cpu_seconds(server.proc.pid)
        res = concurrent_decode(base_url, prompts(c, args.prompt_len, seed + 10 + c), args.new_tokens)
        out[f"decode_tok_s@{c}"] = res["decode_tok_s"]
        # CPU time the server's processes spent per generated token (prefill included): far less
        # sensitive to machine noise than wall-clock rates on a shared 2-core machine.
        out[f"cpu_ms_per_token@{c}"] = 1000 * (tree_cpu_seconds(server.proc.pid) - cpu0) / res["tokens"]
    return out


def combine(paths: list[str], out: str) -> None:
    """Runs of both start orders (``--first``) taken together: on one GPU the server started
    first was faster at batch 1 and slower at batch 8 whichever variant it was (H100,
    2026-12-06), so one order alone measures the order. The variant's own ratio is the geometric
    mean of the runs' median ratios sparse / plain (each order once: the order's effect cancels)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    metrics = list(runs[0]["median"]["sglang"])
    table = {}
    print(f"{'metric':<22}" + "".join(f"{'run ' + str(i):>10}" for i in range(len(runs))) + f"{'both':>10}")
    for m in metrics:
        ratios = [r["median"]["sglang_sparse"][m] / r["median"]["sglang"][m] for r in runs]
        mean = math.prod(ratios) ** (1 / len(ratios))
        table[m] = {"ratios": ratios, "geomean": mean,
                    "overhead": (1 - mean) if m.startswith("decode") else (mean - 1)}  # + = sparse worse
        print(f"{m:<22}" + "".join(f"{x:>10.4f}" for x in ratios) + f"{mean:>10.4f}  overhead {table[m]['overhead']:+.1%}")
    firsts = [r["settings"].get("first", "sglang") for r in runs]
    path = write_json(out, {"command": "python " + " ".join(sys.argv), "runs": paths, "first": firsts,
                            "sparse_over_plain": table})
    print(f"\nwrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--first", choices=sorted(VARIANTS), default="sglang",
                    help="the server started first (on one GPU, the order can matter: run both)")
    ap.add_argument("--out", default="overhead_cpu.json")
    ap.add_argument("--combine", nargs="+", metavar="JSON", help="only combine earlier runs (see combine())")
    ap.add_argument("extra", nargs="*", help="extra SGLang flags for both variants (after --)")
    args = ap.parse_args()
    if args.combine:
        return combine(args.combine, args.out)

    model = args.model_path or str(ensure_default_model())
    import torch

    device = [] if torch.cuda.is_available() else ["--device", "cpu"]
    flags = ["--model-path", model, "--max-total-tokens", str(args.max_total_tokens), *device, *args.extra]
    flags += ["--sleep-on-idle", "--log-level", "warning"]
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    servers = {}
    try:
        start_order = sorted(VARIANTS, key=lambda n: n != args.first)  # --first, then the other
        for name in start_order:
            module = VARIANTS[name]
            t0 = time.monotonic()
            servers[name] = ServerProcess(flags, module=module).start()
            print(f"{name}: ready in {time.monotonic() - t0:.1f}s", flush=True)
        for r in range(args.reps):
            order = start_order if r % 2 == 0 else start_order[::-1]
            for name in order:
                result = measure(servers[name], args, seed=1000 * r)
                runs[name].append(result)
                print(f"rep {r} {name}: " + ", ".join(f"{k}={v:.3f}" for k, v in result.items()), flush=True)
    finally:
        for srv in servers.values():
            srv.stop()

    metrics = list(runs["sglang"][0])
    med = {v: {m: statistics.median(x[m] for x in runs[v]) for m in metrics} for v in VARIANTS}
    print(f"\n{'metric':<22}{'sglang':>12}{'sglang_sparse':>15}{'overhead':>11}")
    overhead = {}
    for m in metrics:
        a, b = med["sglang"][m], med["sglang_sparse"][m]
        overhead[m] = (1 - b / a) if m.startswith("decode") else (b / a - 1)  # + = sparse worse
        print(f"{m:<22}{a:>12.3f}{b:>15.3f}{overhead[m]:>+10.1%}")
    path = write_json(
        args.out,
        {
            "command": "python " + " ".join(sys.argv),
            "machine": platform.platform(),
            "flags": flags,
            "settings": vars(args),
            "runs": runs,
            "median": med,
            "overhead": overhead,
        },
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
