"""Multi-turn agent replay: dense + radix cache vs SnapKV + Chain Cache vs SnapKV without chains.

Synthetic trajectories: each of ``--sessions`` concurrent sessions starts with a system prompt
(``--system`` tokens) and a task, then for ``--turns`` turns the model answers (``--answer``
tokens, greedy, ignore_eos), a simulated tool runs (``--tool-wait`` seconds) and its output
(``--tool-output`` tokens) is appended; the next request resends the whole conversation (token
ids, so prefixes match exactly). SnapKV + chains passes the chain id of its previous turn.

Reported per variant: end-to-end wall time, tokens prefilled (prompt - cached, summed over all
requests, from ``meta_info``), peak KV slots occupied (``/sparse/stats`` polled; radix-cached
KV and idle chains included), and reused tokens.
Final-answer quality is not checked: the token streams are synthetic.

    python benchmark/bench_agent_replay.py                     # CPU, default model
    python benchmark/bench_agent_replay.py --sessions 8 --turns 6 --out agent_replay.json -- <SGLang flags>
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
from common import write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess

VARIANTS = {
    "dense+radix": [],
    "snapkv+chain": ["--sparse-method", "snapkv", "--chain-cache", "on"],
    "snapkv": ["--sparse-method", "snapkv", "--chain-cache", "off"],
}


def session(base_url: str, s: int, args, use_chain: bool, out: list) -> None:
    rng = random.Random(1000 + s)
    ids = [rng.randrange(1000, 30000) for _ in range(args.system)]  # system prompt + task
    chain_id, records = None, []
    for turn in range(args.turns):
        sp = {"temperature": 0, "max_new_tokens": args.answer, "ignore_eos": True}
        if use_chain and chain_id is not None:
            sp["custom_params"] = {"chain_id": chain_id}
        resp = requests.post(base_url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=3600)
        body = resp.json()
        if resp.status_code != 200:
            records.append({"turn": turn, "error": body.get("message")})
            break
        meta = body["meta_info"]
        chain_id = meta.get("chain_id")
        records.append({"turn": turn, "prompt": meta["prompt_tokens"], "cached": meta.get("cached_tokens", 0),
                        "reused": meta.get("reused_tokens", 0)})
        time.sleep(args.tool_wait)  # the tool runs
        ids = ids + body["output_ids"] + [rng.randrange(1000, 30000) for _ in range(args.tool_output)]
    out[s] = records


def run_variant(name: str, args) -> dict:
    flags = VARIANTS[name] + ["--sparse-budget", str(args.budget)] if name != "dense+radix" else []
    flags = flags + ["--max-total-tokens", str(args.pool), "--log-level", "warning", *args.extra]
    with ServerProcess(flags) as srv:
        url, peak, done = srv.base_url, 0, threading.Event()

        def poll() -> None:
            nonlocal peak
            while not done.is_set():
                s = requests.get(url + "/sparse/stats", timeout=60).json()
                peak = max(peak, s["kv_total_slots"] - s["kv_free_slots"])  # incl. radix-cached / chain rows
                time.sleep(0.2)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        out: list = [None] * args.sessions
        t0 = time.monotonic()
        threads = [threading.Thread(target=session, args=(url, s, args, name == "snapkv+chain", out))
                   for s in range(args.sessions)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        done.set()
        poller.join()
        final = requests.get(url + "/sparse/stats", timeout=60).json()
    turns = [r for rs in out for r in rs]
    errors = [r["error"] for r in turns if "error" in r]
    return {"wall_s": wall, "requests": len(turns), "errors": errors[:3],
            "prefilled_tokens": sum(r["prompt"] - r["cached"] for r in turns if "prompt" in r),
            "reused_tokens": sum(r["reused"] for r in turns if "prompt" in r),
            "peak_kv_occupied": peak, "chain_idle_rows_at_end": final.get("chain_idle_rows", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--tool-output", type=int, default=256)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--tool-wait", type=float, default=0.5)
    ap.add_argument("--budget", type=int, default=256, help="SnapKV budget")
    ap.add_argument("--pool", type=int, default=32768)
    ap.add_argument("--out", default="agent_replay_cpu.json")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]
    results = {}
    for name in args.variants:
        results[name] = run_variant(name, args)
        print(name, json.dumps(results[name]), flush=True)
    print(f"\n{args.sessions} sessions x {args.turns} turns; system {args.system}, tool output {args.tool_output}, "
          f"answer {args.answer} tokens, tool wait {args.tool_wait}s, SnapKV budget {args.budget}")
    print(f"{'variant':<14}{'wall s':>9}{'prefilled':>11}{'reused':>9}{'peak KV':>9}{'vs dense':>10}")
    base = results.get("dense+radix", {}).get("wall_s")
    for name, r in results.items():
        speed = f"{base / r['wall_s']:.2f}x" if base else "-"
        print(f"{name:<14}{r['wall_s']:>9.1f}{r['prefilled_tokens']:>11}{r['reused_tokens']:>9}"
              f"{r['peak_kv_occupied']:>9}{speed:>10}")
    path = write_json(args.out, {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                                 "settings": {k: v for k, v in vars(args).items()}, "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
