"""The retention map of each eviction method on one needle prompt, as a heatmap.

For every method one server is started on the default model (or ``--url`` names a running one);
the same needle-in-a-haystack prompt (Paul Graham essays, ``bench_niah.build_prompt``) is sent,
greedy, and the retention map is fetched: ``GET /chain/{id}/retention`` once the request has
finished (methods whose state Chain Cache carries), else ``GET /sparse/requests/{rid}/retention``
while it decodes (methods without chains: kvzip, retroinfer). The plot has one panel per method: layer x
logical position, colour = the fraction of KV heads that keep the position, the needle's tokens
between two red lines. Writes ``results/retention_cpu.{json,png}`` and prints a table.

    python benchmark/plot_retention.py                                  # CPU, ~1.5K-token prompt
    python benchmark/plot_retention.py --methods snapkv h2o --length 2048 --budget 512
    python benchmark/plot_retention.py --url http://127.0.0.1:30000     # a server already running
    python benchmark/plot_retention.py --add --methods skipkv kvzip     # more panels on the saved JSON

Needs matplotlib for the PNG (``pip install -e '.[bench]'``); the JSON and table come without it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_niah import KEYS, NEEDLE, build_prompt, essays_tokens  # noqa: E402
from common import RESULTS, eviction_flags, write_json  # noqa: E402

from sglang_sparse.default_model import ensure_default_model
from sglang_sparse.server_process import ServerProcess


def method_flags(method: str, budget: int, length: int) -> list[str]:
    """Server flags of ``method`` keeping about ``budget`` rows per layer and KV head of a
    ``length``-token prompt (other methods: their defaults); the online evictors every 16 rows."""
    if method == "kvzip":  # a ratio of all (layer, head, position) entries: budget / length on average
        return ["--sparse-keep-ratio", f"{budget / length:.4f}"]
    try:
        flags = eviction_flags(method, budget)
    except KeyError:
        return []
    return flags + (["--sparse-interval", "16"] if method in ("h2o", "rkv", "skipkv") else [])


def find(seq: list[int], sub: list[int]) -> int:
    return next(i for i in range(len(seq) - len(sub) + 1) if seq[i: i + len(sub)] == sub)


def run_one(base_url: str, prompt: list[int], new_tokens: int, rid: str) -> dict:
    """Stream the prompt; the running request's map after the first token, the chain's at the end."""
    body = {"input_ids": prompt, "rid": rid, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    running, chunks = None, []
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=3600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunks.append(json.loads(line[6:]))
            if running is None:
                running = requests.get(f"{base_url}/sparse/requests/{rid}/retention", timeout=600)
    chain_id = next((c["meta_info"]["chain_id"] for c in chunks if "chain_id" in c["meta_info"]), None)
    text = chunks[-1]["text"]
    if chain_id is not None:
        resp = requests.get(f"{base_url}/chain/{chain_id}/retention", timeout=600)
        resp.raise_for_status()
        requests.delete(f"{base_url}/chain/{chain_id}", timeout=600)
        return {"source": f"GET /chain/{{id}}/retention after {new_tokens} tokens", "answer": text,
                "map": resp.json()}
    running.raise_for_status()
    return {"source": "GET /sparse/requests/{rid}/retention after the first token", "answer": text,
            "map": running.json()}


def write_compact(name: str, payload: dict) -> Path:
    """``write_json``, with each result's retention map on one line (the maps are long lists)."""
    maps = {k: r.pop("map") for k, r in payload["results"].items()}
    path = write_json(name, payload)
    text = path.read_text()
    for k, r in payload["results"].items():
        r["map"] = maps[k]
    marker = '"seconds": '  # every result ends with it; its map goes after it
    parts = text.split(marker)
    out = parts[0]
    for k, part in zip(maps, parts[1:]):
        value, rest = part.split("\n", 1)
        out += f'{marker}{value.rstrip(",")},\n      "map": {json.dumps(maps[k], separators=(",", ":"))}\n{rest}'
    path.write_text(out)
    return path


def kept_matrix(rmap: dict):
    """[layers, logical_len]: the fraction of KV heads that keep each position."""
    import numpy as np

    out = np.zeros((rmap["num_layers"], rmap["logical_len"]))
    for layer in rmap["layers"]:
        for head in layer["heads"]:
            for start, end in head["ranges"]:
                out[layer["layer"], start:end] += 1
    return out / max(rmap["kv_heads"], 1)


def summarize(rmap: dict, needle: range) -> dict:
    m = kept_matrix(rmap)
    per_layer = m[:, needle.start: needle.stop].mean(axis=1)  # needle tokens kept, averaged over heads
    return {"kept_fraction": rmap["kept_fraction"], "needle_kept_fraction": round(float(per_layer.mean()), 4),
            "layers_keeping_half_the_needle": int((per_layer >= 0.5).sum()),
            "layers_keeping_none_of_it": int((per_layer == 0).sum()), "layers": rmap["num_layers"]}


def plot(results: dict, needle: range, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: pip install -e '.[bench]' (or pip install matplotlib); no PNG written")
        return False
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.9 * len(results) + 0.6), sharex=True, squeeze=False)
    for ax, (name, res) in zip(axes[:, 0], results.items()):
        m, s = kept_matrix(res["map"]), res["summary"]
        img = ax.imshow(m, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1, origin="lower")
        for x in (needle.start - 0.5, needle.stop - 0.5):
            ax.axvline(x, color="red", lw=0.8, ls="--")
        ax.set_ylabel("layer")
        ax.set_title(f"{name}: {100 * s['kept_fraction']:.1f}% of positions kept; needle: "
                     f"{100 * s['needle_kept_fraction']:.1f}% of its tokens kept, none in "
                     f"{s['layers_keeping_none_of_it']}/{s['layers']} layers; answer names it: "
                     f"{'yes' if res['found'] else 'no'}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("logical position (needle between the red lines)")
    fig.colorbar(img, ax=axes[:, 0].tolist(), fraction=0.02, pad=0.01, label="share of KV heads keeping it")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "streamingllm", "h2o", "rkv"])
    ap.add_argument("--budget", type=int, default=256, help="KV rows kept per layer and head (about)")
    ap.add_argument("--length", type=int, default=1536, help="prompt tokens")
    ap.add_argument("--depth", type=float, default=0.5, help="needle depth in the context (0..1)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--url", help="a running server (its method is the one panel); no server is started")
    ap.add_argument("--out", default="retention_cpu")
    ap.add_argument("--replot", action="store_true", help="redraw the PNG and table from the JSON; no server")
    ap.add_argument("--add", action="store_true",
                    help="keep the saved JSON's panels and add --methods to them (same prompt settings)")
    args = ap.parse_args()
    if args.replot:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        report(saved["results"], range(*saved["needle_positions"]), saved["prompt_tokens"], args.out, None)
        return

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_default_model())
    prompt = build_prompt(tok, essays_tokens(tok), args.length, args.depth)
    start = find(prompt, tok.encode(NEEDLE, add_special_tokens=False))
    needle = range(start, start + len(tok.encode(NEEDLE, add_special_tokens=False)))
    results: dict = {}
    if args.add:  # the panels measured before, on the same prompt
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        if saved["prompt_tokens"] != len(prompt) or saved["needle_positions"] != [needle.start, needle.stop]:
            sys.exit(f"--add: {args.out}.json was made with another prompt; run without --add")
        results = saved["results"]
    for method in ([None] if args.url else args.methods):
        t0 = time.monotonic()
        if args.url:
            res = run_one(args.url, prompt, args.new_tokens, f"retention-{time.time_ns()}")
            name = res["map"]["method"]
        else:
            flags = ["--sparse-method", method, *method_flags(method, args.budget, len(prompt)),
                     "--max-total-tokens", str(4 * len(prompt) + 4096), "--log-level", "warning"]
            with ServerProcess(flags) as srv:
                res = run_one(srv.base_url, prompt, args.new_tokens, f"retention-{method}")
            name = f"{method}@{args.budget}" if method_flags(method, args.budget, len(prompt)) else method
            res["flags"] = flags
        res["summary"] = summarize(res["map"], needle)
        res["found"] = any(k in res["answer"].lower() for k in KEYS)
        res["seconds"] = round(time.monotonic() - t0, 1)
        results[name] = res
        print(f"{name}: {res['seconds']} s", flush=True)

    path = write_compact(f"{args.out}.json", {
        "command": "python " + " ".join(sys.argv), "machine": platform.platform(), "prompt_tokens": len(prompt),
        "needle": NEEDLE, "needle_positions": [needle.start, needle.stop], "depth": args.depth,
        "budget": args.budget, "results": results})
    report(results, needle, len(prompt), args.out, path)


def report(results: dict, needle: range, prompt_tokens: int, out: str, path) -> None:
    png = RESULTS / f"{out}.png"
    drew = plot(results, needle, png)
    print(f"\nprompt {prompt_tokens} tokens, needle at logical [{needle.start}, {needle.stop})")
    print(f"{'method':<18}{'kept':>7}{'needle kept':>13}{'layers >= half':>16}{'layers none':>13}  answer names it")
    for name, res in results.items():
        s = res["summary"]
        print(f"{name:<18}{100 * s['kept_fraction']:>6.1f}%{100 * s['needle_kept_fraction']:>12.1f}%"
              f"{s['layers_keeping_half_the_needle']:>10}/{s['layers']:<5}{s['layers_keeping_none_of_it']:>10}/"
              f"{s['layers']:<5} {'yes' if res['found'] else 'no'}")
    print(f"wrote {', '.join(str(p) for p in (path, png if drew else None) if p)}")


if __name__ == "__main__":
    main()
