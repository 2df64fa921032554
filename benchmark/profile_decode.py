"""Where a decode step's time goes: plain ``sglang.launch_server`` vs ``sglang_sparse.launch_server``
(dense by default, or any sparse method), same flags, one server at a time, each profiled by SGLang's
own ``/start_profile``.

Variants: ``plain`` (SGLang itself), ``dense`` (sglang_sparse, no method), or a method name such as
``omnikv`` (sglang_sparse with ``--sparse-method omnikv``; ``--variant-flags omnikv="..."`` replaces
those flags, e.g. to set the method's options).

Per server: ``--batch`` requests decode together (``--prompt-len`` in each, distinct prompts, greedy,
ignore_eos) and, once every one has its first token, ``/start_profile`` records ``--steps``
scheduler steps (torch profiler, CPU and GPU). The trace is summarized where it was written and
only the summary is kept:

- ``step_ms``: wall time per step (span of the profiled GPU work / steps);
- ``gpu_busy_ms``: GPU time per step inside kernels (union of kernel intervals; on a CPU server,
  of its host ops: ``busy_source`` says which), so
  ``step_ms - gpu_busy_ms`` is time the GPU waited for the host;
- ``kernels``: the kernels by total time per step (name, count per step, us per step);
- ``cpu_ops``: the host-side ops and annotations by total time per step;
- ``idle_gaps_ms``: the longest stretches with no kernel running (a host-side spike, such as an
  eviction planned at a safe point, shows as one long gap);
- ``sparse_stats``: ``/sparse/stats``' steps, counters and timings at the end (sglang_sparse only).

A per-step cost of the extension shows up as a kernel only one side runs (GPU) or as a longer
``step_ms`` at equal ``gpu_busy_ms`` (host). The table prints both servers side by side.

    python benchmark/profile_decode.py --model-path M --out profile.json -- --attention-backend triton ...
    python benchmark/profile_decode.py --model-path M --variants dense omnikv --batch 4 --prompt-len 131072 \
        --variant-flags omnikv="--sparse-method omnikv --sparse-token-budget 2048" --out p.json -- ...
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


def variant_launch(name: str, variant_flags: dict[str, list[str]]) -> tuple[str, list[str]]:
    """(module, extra flags) of one variant: plain SGLang, dense sglang_sparse, or a sparse method
    (``--sparse-method NAME`` unless ``variant_flags`` gives that variant's flags)."""
    if name in variant_flags:
        return MODULES.get(name, MODULES["dense"]), variant_flags[name]
    if name in MODULES:
        return MODULES[name], []
    return MODULES["dense"], ["--sparse-method", name]


def parse_variant_flags(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--variant-flags {item!r}: expected NAME=\"FLAGS\", e.g. omnikv=\"--sparse-method omnikv\"")
        out[name] = flags.split()
    return out


def prompts_for(batch: int, prompt_len: int) -> list[list[int]]:
    """Distinct prompts (each starts with a different token: no shared radix prefix)."""
    return [[1000 + i] + [1000 + (7 * j + 13 * i) % 29000 for j in range(1, prompt_len)] for i in range(batch)]


def stream_until_done(base_url: str, input_ids: list[int], max_new_tokens: int, first: threading.Event,
                      result: dict) -> None:
    """``stream_generate`` in a worker thread: sets ``first`` at the first token; ``result`` gets
    ``tokens`` as they arrive, then ``first``/``end`` (monotonic s), or ``error``."""
    def seen(count: int) -> None:
        result["tokens"] = count
        first.set()

    try:
        done = stream_generate(base_url, input_ids, max_new_tokens, on_tokens=seen)
        result.update(first=done["first"], end=done["end"], tokens=done["tokens"])
    except Exception as exc:  # reported by the caller
        result["error"] = f"{type(exc).__name__}: {exc}"
        first.set()


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


def idle_gaps_ms(intervals: list[tuple[float, float]], top: int = 10) -> list[float]:
    """The longest stretches (ms) in which no kernel ran, longest first: where the device waited
    for the host (e.g. an eviction's planning at a safe point shows as one long gap)."""
    gaps, end = [], None
    for a, b in sorted(intervals):
        if end is not None and a > end:
            gaps.append((a - end) / 1000.0)
        end = b if end is None else max(end, b)
    return sorted(gaps, reverse=True)[:top]


def summarize(trace: dict, steps: int, top: int) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    on_gpu = bool(kernels)
    if not on_gpu:  # a CPU server: the span of its host-side ops stands in (``busy_source`` says so)
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
        "idle_gaps_ms": idle_gaps_ms([(e["ts"], e["ts"] + e["dur"]) for e in kernels]),
        "busy_source": "gpu kernels" if on_gpu else "cpu ops (no GPU kernel in the trace)",
        "kernels_per_step": len(kernels) / steps,
        "kernels": table(by_kernel),
        "cpu_ops": table(by_cpu),
    }


def profile_one(name: str, flags: list[str], args) -> dict:
    module, own = variant_launch(name, args.variant_flags)
    t0 = time.monotonic()
    server = ServerProcess(flags + own, module=module, start_timeout=args.start_timeout).start()
    ready = time.monotonic() - t0
    print(f"{name}: ready in {ready:.1f}s", flush=True)
    try:
        prompts = prompts_for(args.batch, args.prompt_len)
        stream_generate(server.base_url, [7] + prompts[0][1: min(args.prompt_len, 4096) // 2], 16)  # warm-up
        firsts = [threading.Event() for _ in prompts]
        done = [{} for _ in prompts]
        # long enough to outlast the profiled steps whatever the start latency of the profiler
        new = args.warmup_tokens + 8 * args.steps + 512
        workers = [threading.Thread(target=stream_until_done, args=(server.base_url, p, new, f, d))
                   for p, f, d in zip(prompts, firsts, done)]
        for w in workers:
            w.start()
        for f in firsts:  # every request decoding (its prefill done) before the profiler starts
            f.wait()
        # past the first steps of the batch (a count, not a sleep: a fast server would finish
        # its requests before a fixed delay ends, and the profiler would wait for steps forever)
        while not all("error" in d or d.get("tokens", 0) >= args.warmup_tokens or "end" in d for d in done):
            time.sleep(0.05)
        failed = [d["error"] for d in done if "error" in d]
        if failed:
            raise RuntimeError(f"a request failed: {failed[0]}")
        if any("end" in d for d in done):
            raise RuntimeError("a request ended before the profiler started: raise --warmup-tokens' budget")
        out_dir = tempfile.mkdtemp(prefix=f"profile_{name}_")
        import torch

        activities = ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]
        body = {"output_dir": out_dir, "num_steps": args.steps, "activities": activities,
                "profile_id": name}
        r = requests.post(server.base_url + "/start_profile", json=body, timeout=60)
        r.raise_for_status()
        trace = load_trace(out_dir)
        for w in workers:
            w.join()
        summary = summarize(trace, args.steps, args.top)
        st = requests.get(server.base_url + "/sparse/stats", timeout=60)  # plain SGLang: 404
        if st.status_code == 200:  # e.g. timings_us.compaction_decode / counters.decode_compactions
            summary["sparse_stats"] = {k: st.json().get(k) for k in ("steps", "counters", "timings_us")}
        # all requests decode together between the last first token and the first end
        window = min(d["end"] for d in done) - max(d["first"] for d in done)
        summary.update(ready_s=ready, module=module, variant_flags=own,
                       decode_tok_s_whole_request=sum(d["tokens"] - 1 for d in done)
                       / (max(d["end"] for d in done) - min(d["first"] for d in done)),
                       together_window_s=window)
        return summary
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--variants", nargs="+", default=["plain", "dense"],
                    help="plain, dense, or sparse method names (run with --sparse-method NAME)")
    ap.add_argument("--variant-flags", nargs="*", default=[], metavar='NAME="FLAGS"',
                    help="a variant's own server flags instead of --sparse-method NAME")
    ap.add_argument("--batch", type=int, default=1, help="requests decoding together")
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=40, help="decode steps profiled")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="tokens every request has decoded before the profiler starts")
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--start-timeout", type=float, default=400.0)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", required=True)
    ap.add_argument("extra", nargs="*", help="extra SGLang flags for both servers (after --)")
    args = ap.parse_args()
    args.variant_flags = parse_variant_flags(args.variant_flags)

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
    print("\n" + "".join(f"{n}: step {results[n]['step_ms']:.3f} ms, busy ({results[n]['busy_source']}) "
                         f"{results[n]['gpu_busy_ms']:.3f} ms, "
                         f"{results[n]['kernels_per_step']:.0f} kernels\n" for n in ok))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
