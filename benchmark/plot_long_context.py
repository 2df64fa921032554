"""Tables and a plot from the H200 long-context runs in ``benchmark/results/h200/``
(written by ``bench_long_context.py``; see that folder's README for the exact commands).

    python benchmark/plot_long_context.py     # prints the tables, writes summary JSON + PNG
Needs matplotlib for the plot (``pip install -e '.[bench]'``); the tables print without it.
"""

from __future__ import annotations

import json
from pathlib import Path

H200 = Path(__file__).resolve().parent / "results" / "h200"
COLORS = {"plain": "black", "dense": "grey", "quest": "tab:green"}


def load(name: str) -> dict:
    return json.loads((H200 / name).read_text())["results"]


def tok_s(results: dict, method: str) -> dict[int, float]:
    return {int(b): r["decode_tok_s"] for b, r in results.get(method, {}).items() if isinstance(r, dict)}


def main() -> None:
    summary: dict = {}
    cap_dense = load("capacity_32k_run1.json")["dense"]
    cap_snap = load("capacity_32k_snapkv_run2.json")["snapkv"]
    (bd, rd), (bs, rs) = next(iter(cap_dense.items())), next(iter(cap_snap.items()))
    summary["capacity_32k"] = {
        "dense": {"batch": int(bd), "resident": rd["peak_running"], "decode_tok_s": rd["decode_tok_s"]},
        "snapkv_2048": {"batch": int(bs), "resident": rs["peak_running"], "decode_tok_s": rs["decode_tok_s"]},
        "batch_ratio": int(bs) / int(bd), "throughput_ratio": rs["decode_tok_s"] / rd["decode_tok_s"],
    }
    print("Capacity, 32K in / 2K out, KV pool 196,608 tokens (Qwen3-8B shape, H200)")
    for name, row in summary["capacity_32k"].items():
        if isinstance(row, dict):
            print(f"  {name:<12} batch {row['batch']:>3} (resident together: {row['resident']}), "
                  f"{row['decode_tok_s']:7.1f} tok/s")
    c = summary["capacity_32k"]
    print(f"  SnapKV/dense: {c['batch_ratio']:.1f}x batch, {c['throughput_ratio']:.1f}x decode throughput\n")

    m32 = {**load("matched_32k_dense.json"), **load("matched_32k_quest_plain.json")}
    m128 = load("matched_128k.json")
    summary["matched"] = {}
    for label, res, methods in (("32K", m32, ("plain", "dense", "quest")), ("128K", m128, ("dense", "quest"))):
        rows = {m: tok_s(res, m) for m in methods}
        summary["matched"][label] = rows
        print(f"Matched batch at {label} (decode tok/s)")
        batches = sorted(rows["quest"])
        print("  " + f"{'batch':<8}" + "".join(f"{m:>10}" for m in methods) + f"{'quest/dense':>13}")
        for b in batches:
            cells = "".join(f"{rows[m].get(b, float('nan')):>10.1f}" for m in methods)
            print(f"  {b:<8}{cells}{rows['quest'][b] / rows['dense'][b]:>12.2f}x")
        print()
    dense, plain = summary["matched"]["32K"]["dense"], summary["matched"]["32K"]["plain"]
    over = {b: 1 - dense[b] / plain[b] for b in dense if b in plain}
    summary["plugin_overhead_32k"] = over
    print("Plugin overhead, dense through sglang_sparse vs plain SGLang (32K, separate runs): " +
          ", ".join(f"b={b}: {100 * o:+.1f}%" for b, o in over.items()))
    (H200 / "summary.json").write_text(json.dumps(summary, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    ax = axes[0]
    ax.bar(["dense\nbatch %d" % c["dense"]["batch"], "SnapKV 2048\nbatch %d" % c["snapkv_2048"]["batch"]],
           [c["dense"]["decode_tok_s"], c["snapkv_2048"]["decode_tok_s"]], color=["grey", "tab:blue"])
    ax.set_title("32K in / 2K out, 196K-token pool")
    ax.set_ylabel("aggregate decode tok/s")
    for ax, label in zip(axes[1:], ("32K", "128K")):
        for m, rows in summary["matched"][label].items():
            ax.plot(list(rows), list(rows.values()), marker="o", label=m, color=COLORS[m])
        ax.set_title(f"matched batch, {label} context")
        ax.set_xlabel("batch")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.suptitle("Qwen3-8B shape (random weights), one H200, through the real server")
    fig.tight_layout()
    fig.savefig(H200 / "long_context.png", dpi=110)
    print(f"wrote {H200 / 'long_context.png'} and summary.json")


if __name__ == "__main__":
    main()
