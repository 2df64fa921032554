"""Where one Quest decode layer spends its time on the GPU (8B shape: 32 query / 8 KV heads x 128).

Builds one layer's KV pool with ``--batch`` requests of ``--ctx`` tokens on scattered 16-slot
pages, then times each stage of ``QuestRuntime.decode_view_tensors`` + the paged kernel with CUDA
events (median of ``--iters``), and SGLang-shaped dense decode over all pages for scale:

    python3 benchmark/gpu/profile_quest_decode.py --batch 1 8 --ctx 32768 --budget 2048
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from sglang_sparse.kernels import quest_pages
from sglang_sparse.kernels.decode import decode_over_pages

HQ, HKV, D, PAGE = 32, 8, 128, 16


def timed(fn, iters):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1000)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    rows = {}
    for b in args.batch:
        pages_per_req = -(-(args.ctx + 64) // PAGE)
        n_pages = b * pages_per_req + 1
        k_cache = torch.randn(n_pages * PAGE, HKV, D, device=dev, dtype=dt)
        v_cache = torch.randn_like(k_cache)
        perm = torch.randperm(n_pages - 1, device=dev) + 1
        table = torch.zeros(b, pages_per_req * PAGE, dtype=torch.int32, device=dev)
        for i in range(b):
            pg = perm[i * pages_per_req : (i + 1) * pages_per_req]
            table[i] = (pg.view(-1, 1) * PAGE + torch.arange(PAGE, device=dev)).flatten().int()
        kmin, kmax = quest_pages.new_summaries(k_cache.shape[0], PAGE, HKV, D, dt, dev)
        for i in range(b):
            slots = table[i, : args.ctx].long()
            quest_pages.add_keys(kmin, kmax, k_cache[slots], slots, PAGE)
        req = torch.arange(b, device=dev)
        n_rows = torch.full((b,), args.ctx, device=dev)
        q = torch.randn(b, HQ, D, device=dev, dtype=dt)
        slot = table[req, n_rows - 1].long()
        knew = k_cache[slot]
        n_sel = max(3, args.budget // PAGE)
        scores = quest_pages.page_scores(q, kmin, kmax, table, req, n_rows, PAGE)
        picked = quest_pages.top_pages(scores, n_sel)
        all_pages = torch.arange(-(-args.ctx // PAGE), device=dev).view(1, 1, -1).expand(b, HQ, -1).contiguous()
        stages = {
            "add_keys": lambda: quest_pages.add_keys(kmin, kmax, knew, slot, PAGE),
            "page_scores": lambda: quest_pages.page_scores(q, kmin, kmax, table, req, n_rows, PAGE),
            "top_pages": lambda: quest_pages.top_pages(scores, n_sel),
            "paged_attention": lambda: decode_over_pages(q, k_cache, v_cache, table, req, picked, n_rows, PAGE, 0.088),
            "all_pages_attention": lambda: decode_over_pages(q, k_cache, v_cache, table, req, all_pages, n_rows, PAGE, 0.088),
        }
        for f in stages.values():
            f()
        res = {name: timed(f, args.iters) for name, f in stages.items()}
        res["quest_total"] = sum(res[k] for k in ("add_keys", "page_scores", "top_pages", "paged_attention"))
        kv_bytes = b * HQ * n_sel * PAGE * D * 2 * 2
        res["paged_attention_GBps"] = kv_bytes / res["paged_attention"] / 1e3
        rows[b] = res
        print(f"batch {b}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()) + "  (us; GB/s)", flush=True)
        del k_cache, v_cache, kmin, kmax
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": vars(args), "per_layer_us": rows}, f, indent=2)


if __name__ == "__main__":
    main()
