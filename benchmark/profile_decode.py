"""Where a decode step's time goes: plain ``sglang.launch_server`` vs ``sglang_sparse.launch_server``
(dense by default), same flags, one server at a time, each profiled by SGLang's own ``/start_profile``.

Per server: one request decodes (``--prompt-len`` in, greedy, ignore_eos) and, once it is decoding,
``/start_profile`` records ``--steps`` scheduler steps (torch profiler, CPU and GPU). The trace is
summarized where it was written and only the summary is kept:

- ``step_ms``: wall time per step (span of the profiled GPU work / steps);
- ``gpu_busy_ms``: GPU time per step inside kernels (union of kernel intervals), so
  ``step_ms - gpu_busy_ms`` is time the GPU waited for the host;
- ``kernels``: the kernels by total time per step (name, count per step, us per step);
- ``cpu_ops``: the host-side ops and annotations by total time per step.

A per-step cost of the extension shows up as a kernel only one side runs (GPU) or as a longer
``step_ms`` at equal ``gpu_busy_ms`` (host). The table prints both servers side by side.

    python benchmark/profile_decode.py --model-path M --out profile.json -- --attention-backend triton ...
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import stream_generate, write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess

MODULES = {"plain": "sglang.launch_server", "dense": "sglang_sparse.launch_server"}


def load_trace(directory: str, timeout: float = 120.0) -> dict:
    """The trace SGLang's profiler exported into ``directory`` (it writes it after the last step)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        files = sorted(glob.glob(os.path.join(directory, "**", "*.json*"), recursive=True))
        if files:
            size = os.path.getsize(files[0])
            if size and size == last:  # stopped growing
                opener = gzip.open if files[0].endswith(".gz") else open
                with opener(files[0], "rt") as f:
                    return json.load(f)
            last = size
        time.sleep(2)
    raise RuntimeError(f"no profiler trace in {directory} after {timeout:.0f}s")


def union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1000.0


def summarize(trace: dict, steps: int, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:  # a CPU server: the span of its host-side ops stands in
        kernels = [e for e in events if e.get("cat") == "cpu_op"]
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_kernel[e["name"]][0] += 1
        by_kernel[e["name"]][1] += e["dur"]
    by_cpu: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver"):
            by_cpu[e["name"]][0] += 1
            by_cpu[e["name"]][1] += e["dur"]

    def table(d):
        rows = sorted(d.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": n[:160], "per_step": c / steps, "us_per_step": t / steps} for n, (c, t) in rows]

    return {
        "steps": steps,
        "step_ms": (end - start) / 1000.0 / steps,
        "gpu_busy_ms": union_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels]) / steps,
        "kernels_per_step": len(kernels) / steps,
        "kernels": table(by_kernel),
        "cpu_ops": table(by_cpu),
    }


def profile_one(name: str, flags: list[str], args) -> dict:
    t0 = time.monotonic()
    server = ServerProcess(flags, module=MODULES[name], start_timeout=args.start_timeout).start()
    ready = time.monotonic() - t0
    print(f"{name}: ready in {ready:.1f}s", flush=True)
    try:
        prompt = [1000 + (7 * i) % 29000 for i in range(args.prompt_len)]
        stream_generate(server.base_url, prompt[: args.prompt_len // 2], 16)  # warm-up
        done: dict = {}
        worker = threading.Thread(target=lambda: done.update(
            stream_generate(server.base_url, prompt, args.warmup_tokens + 4 * args.steps + 64)))
        worker.start()
        # decoding for a while before the profiler starts: past the prefill and the first steps
        time.sleep(args.settle_s)
        out_dir = tempfile.mkdtemp(prefix=f"profile_{name}_")
        import torch

        activities = ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]
        body = {"output_dir": out_dir, "num_steps": args.steps, "activities": activities,
                "profile_id": name}
        r = requests.post(server.base_url + "/start_profile", json=body, timeout=60)
        r.raise_for_status()
        trace = load_trace(out_dir)
        worker.join()
        summary = summarize(trace, args.steps, args.top)
        summary.update(ready_s=ready, decode_tok_s_whole_request=(done["tokens"] - 1) / (done["end"] - done["first"]))
        return summary
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--variants", nargs="+", default=["plain", "dense"], choices=sorted(MODULES))
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=40, help="decode steps profiled")
    ap.add_argument("--warmup-tokens", type=int, default=400, help="tokens the request decodes besides the profiled ones")
    ap.add_argument("--settle-s", type=float, default=4.0, help="seconds after sending before profiling")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="extra SGLang flags for both servers (after --)")
    args = ap.parse_args()

    flags = ["--model-path", args.model_path, "--max-total-tokens", str(args.max_total_tokens), *args.extra]
    results = {}
    for name in args.variants:
        try:
            results[name] = profile_one(name, flags, args)
        except Exception as exc:  # keep what the other server measured
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: " + json.dumps({k: v for k, v in results[name].items() if k not in ("kernels", "cpu_ops")}),
              flush=True)
        write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                              "flags": flags, "settings": vars(args), "results": results})
    ok = [n for n in args.variants if "error" not in results[n]]
    for section in ("kernels", "cpu_ops"):
        print(f"\n{section} (us per step)")
        names = []
        for n in ok:
            names += [row["name"] for row in results[n][section] if row["name"] not in names]
        print(f"{'':<70}" + "".join(f"{n:>14}" for n in ok))
        for name in names:
            cells = []
            for n in ok:
                row = next((r for r in results[n][section] if r["name"] == name), None)
                cells.append(f"{row['us_per_step']:>9.1f} x{row['per_step']:<3.0f}" if row else f"{'-':>14}")
            print(f"{name[:68]:<70}" + "".join(cells))
    print("\n" + "".join(f"{n}: step {results[n]['step_ms']:.3f} ms, GPU busy {results[n]['gpu_busy_ms']:.3f} ms, "
                         f"{results[n]['kernels_per_step']:.0f} kernels\n" for n in ok))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
