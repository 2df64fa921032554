"""Prefill speed through the real server: FlashPrefill's block-sparse prefill vs dense (issue 17).

Variants (one server each, started once; ``bench_long_context.server`` and its ``variant`` flags):

- ``dense``: sglang_sparse, dense attention (page size 16);
- ``flashprefill``: ``--sparse-prefill flashprefill`` (``methods/flashprefill.py``), dense decode,
  the same page size; ``--flashprefill-threshold 0.9 0.5`` runs one server per threshold
  (``flashprefill@0.9``, ``flashprefill@0.5``); none: the policy's default (0.9).

For each ``--prompt-len`` (ascending) the client sends ``--repeats`` requests one at a time, each a
fresh random prompt (the same prompts for every variant; ``cached_tokens`` is recorded and should
be 0: no radix-cache hit; ``/flush_cache`` after each request empties the pool),
``max_new_tokens=1``, **streamed**: TTFT = client time from sending the request to the first
streamed chunk that carries a token (with one output token that is also the request's end). The
first request per length is a warm-up and is discarded. Prefill tok/s = prompt tokens / TTFT of
the median kept request; ratio = dense's TTFT / the variant's (> 1: faster than dense).

``/sparse/stats`` counters per request (deltas): ``prefill_sparse_chunks`` and
``prefill_dense_chunks`` (chunk x layer; which path ran), ``prefill_blocks_kept`` /
``prefill_blocks_total`` (causal (query block, key block) pairs x query heads; the kept fraction).

Tuning (issue 15's rule, every ratio over the alternative at its best): SGLang's Triton prefill
(extend) kernel has no split count (``--triton-attention-num-kv-splits`` only changes decode), so
the knob both share is the chunk: every server gets the same ``--chunked-prefill-size``
(``--chunk``, default 16,384, twice SGLang's H200 default; 4,096 with ``--cpu``, SGLang's CPU
default). FlashPrefill applies per chunk: a chunk whose keys (its earlier rows + itself) number
fewer than ``--sparse-prefill-min-len`` (4,096 by default; ``--flashprefill-min-len``) stays dense,
every other chunk is block sparse (the first chunk sees only its own keys, later ones the whole
prefix); with a chunk >= min_len every chunk of these prompts is sparse (``prefill_dense_chunks``
0). The same attention backend for every variant (triton on the GPU; torch_native on the CPU,
where the launcher puts FlashPrefill), prefill CUDA graphs off for both (``GPU_FLAGS``; the
launcher turns them off for FlashPrefill anyway). The JSON keeps every server's argv and the
launcher's own additions.

``--cpu``: a smoke run on the default model (SmolLM2-135M, 8,192-token context): 1,024 and 2,048
tokens, ``--sparse-prefill-min-len 512`` so that they are sparse, 2 requests per length, the
torch_native backend for both; about 5 minutes on 2 cores (two server starts of ~1 min each). On
the CPU the block-sparse attention is the plain-torch reference, which computes every logit and
masks the dropped blocks, plus the block mask on top: it checks the served path and the counters,
it is not a speed figure (FlashPrefill comes out slower than dense there).

    python benchmark/bench_prefill.py --cpu
    . benchmark/gpu/env.sh
    python3 benchmark/bench_prefill.py --model-path .gpumodel/qwen3-8b-shape --prompt-len 32768 131072 \\
        --variants flashprefill dense --repeats 2 -- --cuda-graph-bs-decode 1
Flags after ``--`` go to every server.
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_long_context as LC  # noqa: E402
from common import RESULTS, write_json  # noqa: E402

COUNTERS = ("prefill_sparse_chunks", "prefill_dense_chunks", "prefill_blocks_kept", "prefill_blocks_total")


def variant_flags(name: str, args) -> tuple[str, list[str]]:
    """(base variant of ``bench_long_context.variant``, extra flags) of ``dense``, ``flashprefill``
    or ``flashprefill@T``; every variant gets the same chunk and attention backend."""
    base, _, threshold = name.partition("@")
    if base not in ("dense", "flashprefill"):
        raise SystemExit(f"unknown variant {name!r}: dense, flashprefill or flashprefill@THRESHOLD")
    extra = ["--chunked-prefill-size", str(args.chunk)]
    extra += ["--attention-backend", "torch_native"] if args.cpu else []  # (GPU_FLAGS: triton)
    if base == "flashprefill":
        extra += ["--sparse-prefill-threshold", threshold] if threshold else []
        if args.flashprefill_min_len is not None:
            extra += ["--sparse-prefill-min-len", str(args.flashprefill_min_len)]
    return base, extra


def stats(base_url: str) -> dict:
    counters = requests.get(base_url + "/sparse/stats", timeout=60).json().get("counters", {})
    return {k: counters.get(k, 0) for k in COUNTERS}


def prefill_once(base_url: str, ids: list[int], timeout: float) -> dict:
    """One streamed request with one output token: TTFT (client side) and what the server says."""
    stream = LC.Stream(base_url, ids, 1, threading.Event(), timeout=timeout)
    before = stats(base_url)
    t0 = time.monotonic()
    stream.run()  # in this thread: returns when the response ends
    end = time.monotonic()
    if stream.error:
        raise RuntimeError(stream.error)
    after = stats(base_url)
    requests.post(base_url + "/flush_cache", timeout=60)  # the next prefill starts on an empty pool
    meta = stream.meta
    res = {"ttft_s": (stream.times[0] if stream.times else end) - t0, "end_s": end - t0,
           "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens"),
           **{k: after[k] - before[k] for k in COUNTERS}}
    total = res["prefill_blocks_total"]
    res["kept_fraction"] = res["prefill_blocks_kept"] / total if total else None
    return res


def summarize(runs: list[dict], prompt_len: int) -> dict:
    """The median kept request (the warm-up is not in ``runs``)."""
    ttft = statistics.median(r["ttft_s"] for r in runs)
    kept = [r["kept_fraction"] for r in runs if r["kept_fraction"] is not None]
    return {"ttft_s": ttft, "prefill_tok_s": prompt_len / ttft, "n": len(runs),
            "ttft_all_s": [r["ttft_s"] for r in runs], "kept_fraction": statistics.median(kept) if kept else None,
            "sparse_chunks": runs[-1]["prefill_sparse_chunks"], "dense_chunks": runs[-1]["prefill_dense_chunks"]}


def run_variant(name: str, args, save) -> dict:
    base, extra = variant_flags(name, args)
    res: dict = {"extra_flags": extra + args.extra, "lengths": {}}
    try:
        t0 = time.monotonic()
        with LC.server(base, args, extra + args.extra) as srv:
            res["server_argv"] = srv.cmd[3:]
            res["launcher"] = [line.split("sglang_sparse: ", 1)[1] for line in srv.log_tail(200000).splitlines()
                               if "sglang_sparse: " in line][:20]
            print(f"prefill {name} server up in {time.monotonic() - t0:.0f} s", flush=True)
            for length in args.lengths:
                cell: dict = {"warmup": None, "runs": []}
                res["lengths"][str(length)] = cell
                for rep in range(args.repeats):
                    ids = LC.make_prompts(1, length, seed=1_000_003 * rep + length)[0]
                    m = prefill_once(srv.base_url, ids, args.timeout)
                    if rep == 0:
                        cell["warmup"] = m
                    else:
                        cell["runs"].append(m)
                        cell.update(summarize(cell["runs"], length))
                    print(f"prefill {name} L={length} rep={rep}{' (warm-up)' if rep == 0 else ''}",
                          json.dumps(m), flush=True)
                    save()
    except Exception as err:  # keep what was measured; say what failed
        res["error"] = repr(err)[:4000]
        print(f"prefill {name} failed:", repr(err)[:2000], flush=True)
    return res


def table(results: dict, lengths: list[int]) -> list[str]:
    rows = [f"{'variant':<18} {'prompt':>7} {'TTFT s':>8} {'prefill tok/s':>13} {'kept blocks':>11} "
            f"{'sparse/dense chunks':>19} {'x dense':>7} {'n':>2}"]
    for name, res in results.items():
        if "error" in res and not any("ttft_s" in c for c in res["lengths"].values()):
            rows.append(f"{name:<18} failed: {res['error'][:100]}")
        for length in lengths:
            c = res["lengths"].get(str(length), {})
            if "ttft_s" not in c:
                continue
            dense = results.get("dense", {}).get("lengths", {}).get(str(length), {}).get("ttft_s")
            ratio = f"{dense / c['ttft_s']:.2f}x" if dense else "-"
            kept = f"{100 * c['kept_fraction']:.1f}%" if c["kept_fraction"] is not None else "-"
            rows.append(f"{name:<18} {length:>7} {c['ttft_s']:>8.3f} {c['prefill_tok_s']:>13.0f} {kept:>11} "
                        f"{c['sparse_chunks']:>9}/{c['dense_chunks']:<9} {ratio:>7} {c['n']:>2}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M (CPU smoke)")
    ap.add_argument("--cpu", action="store_true", help="smoke run on this CPU (torch_native for every variant)")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=None,
                    help="prompt lengths (default: 32768 131072; --cpu: 1024 2048)")
    ap.add_argument("--variants", nargs="+", default=None, help="dense, flashprefill, flashprefill@T "
                    "(default: dense, then flashprefill at each --flashprefill-threshold)")
    ap.add_argument("--flashprefill-threshold", nargs="*", default=[],
                    help="one flashprefill server per threshold (default: the policy's 0.9)")
    ap.add_argument("--flashprefill-min-len", type=int, default=None,
                    help="--sparse-prefill-min-len for flashprefill servers (default: the policy's 4096; "
                    "--cpu: 512, so that these short prompts are sparse)")
    ap.add_argument("--chunk", type=int, default=None,
                    help="--chunked-prefill-size of every server (default 16384; --cpu: 4096)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="requests per length, the first a discarded warm-up (default 3; --cpu: 2)")
    ap.add_argument("--pool", type=int, default=None, help="KV pool tokens (default: longest prompt + 1024)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out", default=None)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]
    if args.model_path is None:
        from sglang_sparse.default_model import ensure_default_model

        args.model_path = str(ensure_default_model())
    args.prompt_len = args.prompt_len or ([1024, 2048] if args.cpu else [32768, 131072])
    args.repeats = args.repeats or (2 if args.cpu else 3)
    if args.cpu and args.flashprefill_min_len is None:
        args.flashprefill_min_len = 512
    args.chunk = args.chunk or (4096 if args.cpu else 16384)
    args.pool = args.pool or max(args.prompt_len) + 1024
    if args.repeats < 2:
        ap.error("--repeats must be >= 2 (the first request per length is discarded)")
    variants = args.variants or ["dense", *([f"flashprefill@{t}" for t in args.flashprefill_threshold]
                                            or ["flashprefill"])]
    # what bench_long_context.server reads: the longest prompt sets --context-length, one output token
    srv_args = argparse.Namespace(**{**vars(args), "prompt_len": max(args.prompt_len), "output_len": 1,
                                     "budget": 0, "lengths": sorted(args.prompt_len)})
    out = args.out or f"prefill_{'cpu' if args.cpu else 'gpu'}.json"
    # `timeout` sends SIGTERM: leave through the server's `with`, which stops it (the JSON is
    # already written after every request)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results: dict[str, dict] = {}
    tuning = {"chunked_prefill_size": args.chunk, "attention_backend": "torch_native" if args.cpu else "triton",
              "note": "Triton prefill has no kv-splits knob; the same chunk and backend for every variant; "
                      "argv per variant under results.<variant>.server_argv"}

    def save() -> None:
        write_json(out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                         "settings": {k: v for k, v in vars(args).items()}, "tuning": tuning,
                         "ttft": "client side, streamed: request sent -> first chunk with a token",
                         "results": results})

    for name in variants:
        results[name] = run_variant(name, srv_args, save)
        save()
    print(f"\nprefill: one request at a time, max_new_tokens=1, streamed TTFT (client), median of "
          f"{args.repeats - 1} after a warm-up; chunk {args.chunk}")
    print("\n".join(table(results, sorted(args.prompt_len))))
    print(f"wrote {RESULTS / out}")  # the last save()'s file (an absolute --out stays as is)


if __name__ == "__main__":
    main()
