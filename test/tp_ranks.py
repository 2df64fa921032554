"""The workloads of ``test_tp_agreement.py``: one request per method through the toy engine, run
once with every head (the reference) and once per rank of a 2-process gloo group holding half of
the heads (``core.tensor_parallel.HeadShards``), as SGLang's ``--tp-size 2`` splits them."""

from __future__ import annotations

import os

import torch

from sglang_sparse.core import pruning
from sglang_sparse.core.tensor_parallel import HeadShards, SingleRank
from sglang_sparse.methods.kvzip import CONTEXT_KEY
from toy_engine import HKV, HQ, LAYERS, D, ToyEngine, qkv

# method, options, prompt tokens, prompt chunk, decode steps, starting metadata
CASES = {
    "snapkv": ("snapkv", {"budget": 16, "window": 4, "kernel": 3}, 60, 7, 3, None),
    "pyramidkv": ("pyramidkv", {"budget": 16, "window": 4, "kernel": 3}, 60, 7, 3, None),
    "h2o": ("h2o", {"budget": 16, "recent": 4, "interval": 2}, 50, 7, 6, None),
    "rkv": ("rkv", {"budget": 16, "window": 4, "interval": 4, "kernel": 3}, 50, 7, 6, None),
    "skipkv": ("skipkv", {"budget": 24, "sinks": 2, "recent": 4, "interval": 4, "max_segment": 3}, 50, 7, 6, None),
    "kvzip": ("kvzip", {"keep_ratio": 0.3, "sinks": 4}, 90, 13, 2, {CONTEXT_KEY: 40}),
    "streamingllm": ("streamingllm", {"sinks": 2, "recent": 8, "evict_every": 3}, 40, 7, 6, None),
    "quest": ("quest", {"page_size": 4, "token_budget": 12, "dense_layers": 1}, 60, 16, 3, None),
    "omnikv": ("omnikv", {"filter_layers": "1", "token_budget": 8}, 60, 16, 3, None),
    "kivi": ("kivi", {"bits": 2, "group": 8, "residual": 16}, 100, 32, 12, None),
    "turboquant": ("turboquant", {"bits": 3, "group": 8, "residual": 16, "seed": 3}, 100, 32, 12, None),
    "retroinfer": ("retroinfer", {"segment": 32, "tokens_per_cluster": 4, "retrieve": 3, "sinks": 2, "local": 4,
                                  "kmeans_iters": 5}, 60, 16, 3, None),
}


def _share(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This rank's heads of ``[tokens, heads, d]`` (SGLang: rank r holds heads [r*h, (r+1)*h))."""
    per = t.shape[1] // size
    return t[:, rank * per: (rank + 1) * per]


def _views(views) -> list:
    """The decode views' per-head tensors, copied (the next step overwrites them)."""
    out = []
    for layer, v in views:
        if v is None:
            continue
        if hasattr(v, "page_ids"):  # Quest: [B, H_q, n] pages per query head
            out.append((layer, "page_ids", v.page_ids.clone()))
        elif hasattr(v, "sel_rows"):  # OmniKV: [B, N] rows shared by every head
            out.append((layer, "sel_rows", v.sel_rows.clone()))
        elif hasattr(v, "attend"):  # the method computes attention itself (RetroInfer): [B, H_q, d]
            out.append((layer, "out", v.attend(D ** -0.5).clone()))
    return out


def run_case(name: str, heads: SingleRank, rank: int = 0, size: int = 1) -> dict:
    method, knobs, length, chunk, decodes, metadata = CASES[name]
    q, k, v = qkv(length, seed=7)
    q, k, v = ([_share(x, rank, size) for x in t] for t in (q, k, v))
    eng = ToyEngine(method, knobs, kv_heads=HKV // size, heads=heads)
    free0 = eng.store.free_count()
    freed = [eng.prefill("a", 0, q, k, v, chunk, metadata=metadata)]
    views = []
    for t in range(decodes):
        dq, dk, dv = qkv(1, seed=100 + t)
        dq, dk, dv = ([_share(x, rank, size) for x in u] for u in (dq, dk, dv))
        eng.views.clear()
        freed.append(eng.decode("a", 0, dq, dk, dv))
        views.append(_views(eng.views))
    ret = eng.ctl.cache.retained("a")
    out = {"freed": freed, "free": eng.store.free_count(), "rows": ret.n_rows, "logical": ret.logical_len,
           "positions": [ret.layer_positions(layer).clone() for layer in range(LAYERS)], "views": views,
           "counters": dict(eng.ctl.runtime.counters)}
    blocks = getattr(eng.ctl.runtime, "blocks", None)
    if blocks is not None:
        out["blocks_free"] = blocks.free_count()
    eng.finish("a", 0)
    out["free_after"], out["free0"] = eng.store.free_count(), free0
    return out


def prune_mask(heads: SingleRank, rank: int = 0, size: int = 1) -> torch.Tensor:
    """``/prune``'s keep mask: per layer the probe's attention ``[Hq, s, m]`` over an interval of
    m tokens, reduced per head (this rank's), the maximum over layers, then over ranks."""
    g = torch.Generator().manual_seed(3)
    scores = torch.full((30,), float("-inf"))
    for _ in range(LAYERS):
        probs = torch.rand(HQ, 5, 30, generator=g).softmax(dim=-1)
        per = HQ // size
        scores = torch.maximum(scores, pruning.layer_scores("snapkv", probs[rank * per: (rank + 1) * per]))
    heads.max_(scores)
    return pruning.keep_mask(scores, torch.arange(30), keep=12)


def rank_main(rank: int, size: int, init_file: str, out_dir: str) -> None:
    """One rank of the gloo group: every case, saved to ``out_dir/rank<r>.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=size)
    heads = HeadShards(dist.group.WORLD)
    results = {name: run_case(name, heads, rank, size) for name in CASES}
    results["prune"] = prune_mask(heads, rank, size)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()
