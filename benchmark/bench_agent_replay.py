"""Multi-turn agent replay: dense + radix cache vs an eviction method + Chain Cache vs the method
without chains, and dense + radix cache with prefix-cache pruning of old tool results (``/prune``).

Variants: ``dense+radix``; ``M+chain`` and ``M`` for any eviction method M of ``common.eviction_flags``
(``snapkv``, ``pyramidkv``, ``h2o``, ``rkv``, ``skipkv``, ``streamingllm``; budget ``--budget``;
``kvzip``: keep ratio ``budget / 8192`` of each turn's new context);
``dense+prune@R``. With ``--gpu`` the servers get ``bench_long_context.GPU_FLAGS`` (dummy weights,
Triton attention) and ``--model-path``; ``--kv-splits`` sweeps SGLang's
``--triton-attention-num-kv-splits`` for the dense variants and keeps the fastest (all kept in
the JSON under ``tuning``), so every ratio is over dense + radix at its best; ``--compile-splits``
adds dense runs with ``--enable-torch-compile`` (``--torch-compile-max-bs``) at those split counts.
A sweep that does not fit one GPU call runs in several (one ``--out`` each); ``--merge A.json
B.json ... --out C.json`` then keeps, per variant, the best run of all the files (every run kept
under ``tuning``) and prints the table.

Synthetic trajectories: each of ``--sessions`` concurrent sessions starts with a system prompt
(``--system`` tokens) and a task, then for ``--turns`` turns the model answers (``--answer``
tokens, greedy, ignore_eos), a simulated tool runs (``--tool-wait`` seconds) and its output
(``--tool-output`` tokens) is appended; the next request resends the whole conversation (token
ids, so prefixes match exactly). SnapKV + chains passes the chain id of its previous turn.

Reported per variant: end-to-end wall time, tokens prefilled (prompt - cached, summed over all
requests, from ``meta_info``), peak KV slots occupied (``/sparse/stats`` polled; radix-cached
KV and idle chains included), and reused tokens.
Pruning variants (``dense+prune@R``): once a tool result is ``--prune-lag`` rounds old it is
pruned once (kvzip, keep ratio R), the paper's delayed pruning; they also report the pool slots
still occupied at the end (the cached conversations) and, as a quality proxy, how many sessions'
final answers equal those of ``dense+radix`` (the token streams are synthetic, so there is no
task answer to check; agreement with unpruned decoding is what can be measured).

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
from common import eviction_flags, write_json  # noqa: E402

from sglang_sparse.server_process import ServerProcess

DEFAULT_VARIANTS = ["dense+radix", "snapkv+chain", "snapkv", "dense+prune@0.2", "dense+prune@0.5"]


def variant_flags(name: str, budget: int) -> list[str]:
    """Server flags of a variant name (see the module docstring); ValueError for an unknown one."""
    if name == "dense+radix" or prune_ratio(name) is not None:
        return []
    method, _, chain = name.partition("+")
    if chain not in ("", "chain"):
        raise ValueError(f"unknown variant {name!r}")
    return ["--sparse-method", method, *eviction_flags(method, budget), "--chain-cache", "on" if chain else "off"]


def prune_ratio(name: str) -> float | None:
    return float(name.split("@")[1]) if name.startswith("dense+prune@") else None


def is_dense(name: str) -> bool:
    return name == "dense+radix" or prune_ratio(name) is not None


def session(base_url: str, s: int, args, use_chain: bool, out: list, keep: float | None = None) -> None:
    rng = random.Random(1000 + s)
    ids = [rng.randrange(1000, 30000) for _ in range(args.system)]  # system prompt + task
    chain_id, records, spans = None, [], []  # spans: [L, R) of each tool result in ids
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
        records[-1]["answer"] = body["output_ids"]
        cached = ids + body["output_ids"]
        if keep is not None and len(spans) > args.prune_lag:  # the result prune_lag rounds back
            left, right = spans[-args.prune_lag - 1]
            t0 = time.monotonic()
            rec = requests.post(base_url + "/prune", timeout=3600, json={
                "token_ids": cached, "ranges": [[left, right]], "keep_ratio": keep, "policy": "kvzip",
                "wait": True}).json()
            records[-1]["prune"] = {"status": rec.get("status"), "freed": rec.get("freed_slots", 0),
                                    "seconds": time.monotonic() - t0}
        time.sleep(args.tool_wait)  # the tool runs
        spans.append((len(cached), len(cached) + args.tool_output))
        ids = cached + [rng.randrange(1000, 30000) for _ in range(args.tool_output)]
    out[s] = records


def config_key(splits: int | None, compiled: bool) -> str:
    """The tuning key of one dense configuration: ``16``, ``16+compile``, ``default``."""
    return ("default" if splits is None else str(splits)) + ("+compile" if compiled else "")


def run_variant(name: str, args, splits: int | None = None, compiled: bool = False) -> dict:
    flags = variant_flags(name, args.budget) + ["--max-total-tokens", str(args.pool), "--log-level", "warning"]
    if args.gpu:
        from bench_long_context import GPU_FLAGS

        flags += [*GPU_FLAGS, "--model-path", args.model_path]
    elif args.model_path:
        flags += ["--model-path", args.model_path]
    if splits is not None:
        flags += ["--triton-attention-num-kv-splits", str(splits)]
    if compiled:
        flags += ["--enable-torch-compile", "--torch-compile-max-bs", str(args.torch_compile_max_bs)]
    with ServerProcess(flags + args.extra, start_timeout=args.start_timeout) as srv:
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
        threads = [threading.Thread(target=session, args=(url, s, args, name.endswith("+chain"), out,
                                                          prune_ratio(name)))
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
    prunes = [r["prune"] for r in turns if "prune" in r]
    return {"wall_s": wall, "requests": len(turns), "errors": errors[:3], "kv_splits": splits,
            "torch_compile": compiled,
            "prefilled_tokens": sum(r["prompt"] - r["cached"] for r in turns if "prompt" in r),
            "reused_tokens": sum(r["reused"] for r in turns if "prompt" in r),
            "peak_kv_occupied": peak, "kv_occupied_at_end": final["kv_total_slots"] - final["kv_free_slots"],
            "chain_idle_rows_at_end": final.get("chain_idle_rows", 0),
            "prunes": {"done": sum(p["status"] == "completed" for p in prunes), "not_done": [p["status"] for p in prunes
                       if p["status"] != "completed"], "freed_slots": sum(p["freed"] for p in prunes),
                       "seconds": sum(p["seconds"] for p in prunes)},
            "final_answers": [rs[-1].get("answer") if rs else None for rs in out]}


def best_run(runs: dict) -> dict:
    """The fastest run without errors (else the first one, which says what failed)."""
    ok = {k: r for k, r in runs.items() if "wall_s" in r and not r["errors"]}
    return min(ok.values(), key=lambda r: r["wall_s"]) if ok else next(iter(runs.values()))


def merge(paths: list[str]) -> tuple[dict, dict, dict]:
    """Results of several runs of this script (e.g. one per GPU call): per variant the fastest
    run of all the files; ``tuning`` keeps every run's wall time by ``file:config``; ``sources``
    each file's command. A file's runs of one variant are its best (``results``) plus its sweep."""
    runs: dict[str, dict] = {}
    tuning: dict[str, dict] = {}
    sources = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        sources[Path(path).name] = data.get("command")
        settings = data.get("settings", {})
        for name, r in data["results"].items():
            splits, compiled = r.get("kv_splits"), r.get("torch_compile", False)
            if "error" in r and "kv_splits" not in r and is_dense(name):  # older files: the file's one config
                one = [(s, True) for s in settings.get("compile_splits", [])] + [(s, False) for s in settings.get("kv_splits", [])]
                splits, compiled = one[0] if len(one) == 1 else (None, False)
            key = f"{Path(path).name}:{config_key(splits, compiled)}"
            runs.setdefault(name, {})[key] = r
            tuning.setdefault(name, {})[key] = r.get("wall_s", r.get("error"))
            for cfg, wall in data.get("tuning", {}).get(name, {}).items():  # the file's other configs
                tuning[name].setdefault(f"{Path(path).name}:{cfg}", wall)
    results = {name: best_run(r) for name, r in runs.items()}
    return results, {k: v for k, v in tuning.items() if len(v) > 1}, sources


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--gpu", action="store_true", help="GPU server flags (bench_long_context.GPU_FLAGS)")
    ap.add_argument("--kv-splits", type=int, nargs="*", default=[],
                    help="--triton-attention-num-kv-splits values swept for the dense variants (best wall kept)")
    ap.add_argument("--compile-splits", type=int, nargs="*", default=[],
                    help="kv-splits values run with --enable-torch-compile for the dense variants (swept too)")
    ap.add_argument("--torch-compile-max-bs", type=int, default=8)
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no servers: merge these result files (best run per variant) into --out")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024)
    ap.add_argument("--tool-output", type=int, default=256)
    ap.add_argument("--answer", type=int, default=16)
    ap.add_argument("--tool-wait", type=float, default=0.5)
    ap.add_argument("--budget", type=int, default=256, help="rows per request of the eviction methods")
    ap.add_argument("--pool", type=int, default=32768)
    ap.add_argument("--prune-lag", type=int, default=1, help="prune a tool result once it is this many rounds old")
    ap.add_argument("--out", default="agent_replay_cpu.json")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]
    if args.merge:
        results, tuning, sources = merge(args.merge)
        first = json.loads(Path(args.merge[0]).read_text())["settings"]  # the workload, for the header
        for key in ("sessions", "turns", "system", "tool_output", "answer", "tool_wait", "budget"):
            setattr(args, key, first[key])
    else:
        for name in args.variants:
            variant_flags(name, args.budget)  # an unknown name fails before any server starts
        results, tuning, sources = {}, {}, None

    def save() -> Path:
        """The JSON so far: written after every variant, so a run cut by a call's limit keeps
        what it measured."""
        body = {"command": "python " + " ".join(sys.argv), "machine": platform.platform(),
                "settings": {k: v for k, v in vars(args).items()}, "tuning": tuning, "results": results}
        if sources is not None:
            body["sources"] = sources
        return write_json(args.out, body)

    if not args.merge:
        for name in args.variants:
            dense = is_dense(name)
            sweep = [(s, False) for s in args.kv_splits] + [(s, True) for s in args.compile_splits] if dense else []
            sweep = sweep or [(None, False)]
            runs = {}
            for splits, compiled in sweep:
                key = config_key(splits, compiled)
                try:
                    runs[key] = run_variant(name, args, splits, compiled)
                except Exception as err:  # keep what was measured; say what failed
                    runs[key] = {"error": repr(err), "kv_splits": splits, "torch_compile": compiled}
                print(name, key, json.dumps(runs[key]), flush=True)
                results[name] = best_run(runs)
                if len(sweep) > 1:
                    tuning[name] = {k: r.get("wall_s", r.get("error")) for k, r in runs.items()}
                save()
    print(f"\n{args.sessions} sessions x {args.turns} turns; system {args.system}, tool output {args.tool_output}, "
          f"answer {args.answer} tokens, tool wait {args.tool_wait}s, eviction budget {args.budget}")
    print(f"{'variant':<17}{'wall s':>8}{'prefilled':>11}{'reused':>9}{'peak KV':>9}{'KV at end':>10}"
          f"{'freed':>7}{'same answer':>12}{'vs dense':>10}")
    base = results.get("dense+radix", {})
    for name, r in results.items():
        if "wall_s" not in r:
            print(f"{name:<17} failed: {r.get('error')}")
            continue
        speed = f"{base['wall_s'] / r['wall_s']:.2f}x" if "wall_s" in base else "-"
        same = "-"
        if "wall_s" in base and name.startswith("dense+prune"):
            pairs = list(zip(base["final_answers"], r["final_answers"]))
            same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        print(f"{name:<17}{r['wall_s']:>8.1f}{r['prefilled_tokens']:>11}{r['reused_tokens']:>9}"
              f"{r['peak_kv_occupied']:>9}{r['kv_occupied_at_end']:>10}{r['prunes']['freed_slots']:>7}{same:>12}{speed:>10}")
    print(f"wrote {save()}")


if __name__ == "__main__":
    main()
