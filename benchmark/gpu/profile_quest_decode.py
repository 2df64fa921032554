"""Where one sparse decode layer spends its time on the GPU (8B shape: 32 query / 8 KV heads x 128).

Builds one layer's KV pool with ``--batch`` requests of ``--ctx`` tokens on scattered 16-slot
pages, then times each stage of Quest's decode (``QuestRuntime.decode_view_tensors`` + the paged
kernel) and of OmniKV's (a filter layer's logits and selection, a later layer's rows + tail
attention), and decode over all pages for scale. Each stage is timed with CUDA events, median of
``--iters``. ``--graph`` captures each stage into a CUDA graph first and times replays, as the
server's decode graphs run them (no Python or launch gaps; without it the eager figures include
them):

    python3 benchmark/gpu/profile_quest_decode.py --batch 1 4 --ctx 131072 --budget 2048 --graph
"""

from __future__ import annotations

import argparse
import json

import torch

from sglang_sparse.kernels import quest_pages
from sglang_sparse.kernels.decode import decode_over_pages, decode_over_rows_tail
from sglang_sparse.methods.omnikv import select_from_logits
from sglang_sparse.kernels import token_logits
from tune_quest_kernels import make_timer, time_us  # this folder (the script's own)

HQ, HKV, D, PAGE = 32, 8, 128, 16


def timed(fn, iters, graph=False):
    """Median microseconds of ``fn`` (a CUDA-graph replay of it with ``graph``); on a CPU smoke
    run of the script, eager wall time (figures meaningless)."""
    cuda = torch.cuda.is_available()
    return time_us(make_timer([fn], cuda) if graph else fn, iters, cuda)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--layers", type=int, default=36, help="layers per step for the step estimates")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays of each stage")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
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
        prompt_rows = torch.full((b,), args.ctx - 32, device=dev)  # OmniKV: 32 generated rows
        logits = token_logits(q, k_cache, table, req, n_rows, 0.088)
        sel = select_from_logits(logits, prompt_rows, args.budget)
        stages = {
            "add_keys": lambda: quest_pages.add_decode_keys(kmin, kmax, knew, slot, PAGE),
            "add_keys_scatter": lambda: quest_pages.add_keys(kmin, kmax, knew, slot, PAGE),  # before
            "page_scores": lambda: quest_pages.page_scores(q, kmin, kmax, table, req, n_rows, PAGE),
            "top_pages": lambda: quest_pages.top_pages(scores, n_sel),
            "top_pages_torch_topk": lambda: scores.topk(n_sel, dim=-1),  # what Quest used before
            "paged_attention": lambda: decode_over_pages(q, k_cache, v_cache, table, req, picked, n_rows, PAGE, 0.088),
            "all_pages_attention": lambda: decode_over_pages(q, k_cache, v_cache, table, req, all_pages, n_rows, PAGE, 0.088),
            "omnikv_token_logits": lambda: token_logits(q, k_cache, table, req, n_rows, 0.088),
            "omnikv_select": lambda: select_from_logits(logits, prompt_rows, args.budget),
            "omnikv_rows_tail_attention": lambda: decode_over_rows_tail(q, k_cache, v_cache, table, req, sel,
                                                                        prompt_rows, n_rows, 0.088),
        }
        for f in stages.values():
            f()
        res = {name: timed(f, args.iters, args.graph) for name, f in stages.items()}
        res["quest_total"] = sum(res[k] for k in ("add_keys", "page_scores", "top_pages", "paged_attention"))
        # One decode step's attention work over the model's layers (8B shape: 36), from the
        # per-layer figures: dense reads all pages in every layer; Quest keeps its first 2 layers
        # dense; OmniKV (filter layers 2, 8, 18) runs layers 0-1 dense, each filter layer dense +
        # logits + selection, every other layer rows + tail.
        full = res["all_pages_attention"]
        res["step_dense_ms"] = args.layers * full / 1e3
        res["step_quest_ms"] = (2 * full + (args.layers - 2) * res["quest_total"]) / 1e3
        filt = full + res["omnikv_token_logits"] + res["omnikv_select"]
        res["step_omnikv_ms"] = (2 * full + 3 * filt + (args.layers - 5) * res["omnikv_rows_tail_attention"]) / 1e3
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
