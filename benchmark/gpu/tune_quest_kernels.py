"""Tune the launch options of Quest's served decode kernels on one GPU, as the server runs them.

For each ``--batch``, builds ``--layers`` distinct layers of an 8B-shape KV pool (32 query / 8
KV heads x 128, bf16) holding ``--ctx``-token requests on shuffled, aligned 16-slot pages (SGLang
with ``--page-size 16``) and their per-page key summaries. Each stage of a sparse decode layer
(``QuestRuntime.decode_view_tensors`` + the paged kernel):

- ``quest_page_scores_paged``  ``block_p`` x ``num_warps``
- ``select_top``               ``method`` (bits / radix / nibble) x ``num_warps`` x ``chunk``, over the
  ``B x Hq`` rows of per-query-head selection and (``select_top_kv``) the ``B x Hkv`` rows of
  ``kv_head`` selection; the table keys selection by its number of rows
- ``paged_sparse_decode_attention``  ``num_splits`` x ``block_n`` x ``num_warps`` x variant
  (``aligned``: one table entry per page; ``prefetch``: next tile's ids ahead; ``stages2/3``:
  Triton loop pipelining)
- ``paged_gqa_decode_attention`` (``--sparse-select-per kv_head``: one page set per KV head, each
  page loaded once for its query heads)  ``num_splits`` x ``block_n`` x ``num_warps`` x variant
  (``GQA_VARIANTS``: plain, Triton pipelining, ``prefetch``); its lines also give the
  bandwidth the kernel draws on the bytes it must read (each chosen row once per KV head)

is captured into a CUDA graph that runs it once per layer (distinct KV per layer, as in a step:
nothing stays in L2 from the previous call) and timed over replays: per config the median of
``--reps`` replays, in ``--rounds`` rounds that interleave all configs of a stage (clock drift
hits every config alike); the figure is the median over rounds, per layer. Every config's output
is checked against the stage's built-in default (same page ids for the selection, allclose for
attention); a config that disagrees is reported and never chosen. Then the whole sparse layer
(fold + scores + selection + attention) with the defaults and with the best of each stage, per
query head (``head``, the default) and per KV head (``kv_head``: scores summed over each group,
selection over ``B x Hkv`` rows, the GQA kernel).

``--write-config F`` writes the best configs in ``sgl_kernel_sparse.tuning``'s format
(``--write-config-dir D``: to ``D/<this GPU's config name>``, e.g. ``NVIDIA_H200.json``); copy it
to ``sgl-kernel-sparse/python/sgl_kernel_sparse/configs/`` to make the server use it. A batch's
entries for a path (per query head / per KV head) are written only if that whole tuned layer
measured faster than the defaults (``table_entries``; ``_meta.dropped`` says what was left out).
``--time-limit`` stops the sweep (what is measured is kept and written) before a call's limit.

    python3 benchmark/gpu/tune_quest_kernels.py --batch 1 2 4 --ctx 131072 --budget 2048 \\
        --out quest_tuning.json --write-config-dir .

Without a GPU (CI) it runs the same code on tiny shapes under the Triton interpreter with eager
timing (``TRITON_INTERPRET=1``, figures meaningless): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from sgl_kernel_sparse import tuning
from sglang_sparse.kernels import quest_pages

HQ, HKV, D, PAGE = 32, 8, 128, 16
ATTN_VARIANTS = {  # name -> launch options (every variant on Quest's aligned pages)
    "aligned": dict(prefetch=False, num_stages=0),
    "prefetch": dict(prefetch=True, num_stages=0),
    "stages2": dict(prefetch=False, num_stages=2),
    "stages3": dict(prefetch=False, num_stages=3),
}
GQA_VARIANTS = {  # the GQA kernel's: a plain loop, Triton pipelining, the next tile's slots ahead
    "plain": dict(prefetch=False),
    "stages2": dict(prefetch=False, num_stages=2),
    "prefetch": dict(prefetch=True),
}


def grids(quick: bool) -> dict:
    """Config grids per stage; ``{}`` (the built-in heuristics) first: the baseline."""
    if quick:
        return {"quest_page_scores_paged": [{}, dict(block_p=16, num_warps=2)],
                "select_top": [{}, dict(method="radix"), dict(method="nibble")],
                "select_top_kv": [{}, dict(method="radix"), dict(method="nibble")],
                "paged_sparse_decode_attention": [{}, dict(num_splits=2, block_n=16, num_warps=2, **ATTN_VARIANTS["prefetch"]),
                                                  dict(num_splits=2, block_n=16, **ATTN_VARIANTS["stages2"])],
                "paged_gqa_decode_attention": [{}, dict(num_splits=2, block_n=16, num_warps=2),
                                               dict(num_splits=2, block_n=16, num_warps=2, **GQA_VARIANTS["prefetch"])]}
    scores = [{}] + [dict(block_p=p, num_warps=w) for p in (16, 32, 64, 128) for w in (2, 4, 8)]
    select = [{}] + [dict(method=m, num_warps=w, chunk=c) for m in ("nibble", "bits", "radix")
                     for w in (4, 8, 16, 32)
                     for c in (1024, 4096)]
    attn = [{}] + [dict(num_splits=s, block_n=bn, num_warps=w, **ATTN_VARIANTS[v])
                   for v in ATTN_VARIANTS for s in (None, 8, 16, 32, 64) for bn in (16, 32, 64) for w in (4, 8)]
    gqa = [{}] + [dict(num_splits=s, block_n=bn, num_warps=w, **GQA_VARIANTS[v]) for s in (None, 16, 32, 64)
                  for bn in (32, 64) for w in (2, 4, 8) for v in GQA_VARIANTS]
    return {"quest_page_scores_paged": scores, "select_top": select, "select_top_kv": select,
            "paged_sparse_decode_attention": attn, "paged_gqa_decode_attention": gqa}


class Layer:
    """One layer's KV pool and page summaries; the slot table is shared by all layers (as SGLang's
    ``req_to_token``)."""

    def __init__(self, n_slots, dev, dt, g):
        self.k = torch.randn(n_slots, HKV, D, device=dev, generator=g).to(dt)
        self.v = torch.randn(n_slots, HKV, D, device=dev, generator=g).to(dt)
        # whole aligned pages: a page's summary is the min / max over its 16 slots
        pages = self.k.view(-1, PAGE, HKV, D)
        self.kmin, self.kmax = pages.amin(1).contiguous(), pages.amax(1).contiguous()


def build(b, ctx, n_layers, dev, dt, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    pages_per_req = -(-(ctx + 64) // PAGE)
    n_pages = b * pages_per_req + 1  # pool page 0: the engine's padding page
    perm = torch.randperm(n_pages - 1, device=dev, generator=g) + 1
    table = (perm.view(b, pages_per_req, 1) * PAGE + torch.arange(PAGE, device=dev)).view(b, -1).int()
    layers = [Layer(n_pages * PAGE, dev, dt, g) for _ in range(n_layers)]
    q = torch.randn(b, HQ, D, device=dev, generator=g).to(dt)
    req = torch.arange(b, device=dev)
    n_rows = torch.full((b,), ctx, device=dev)
    return layers, table, q, req, n_rows


def stage_fns(stage, cfg, st):
    """Callables (one per layer) running ``stage`` with launch options ``cfg`` (the Triton
    wrappers themselves: what the package's dispatch calls on CUDA)."""
    from sgl_kernel_sparse import triton_ops as K

    layers, table, q, req, n_rows, n_sel, scores, scores_kv, picked, picked_kv = st
    n_pages = (n_rows.long() + PAGE - 1) // PAGE
    if stage == "paged_gqa_decode_attention":
        return [lambda L=L, p=p: K.paged_gqa_decode_attention(q, L.k, L.v, table, req, p, n_rows, PAGE, 0.088,
                                                              aligned=True, **cfg)
                for L, p in zip(layers, picked_kv)]
    if stage == "quest_page_scores_paged":
        return [lambda L=L: K.quest_page_scores_paged(q, L.kmin, L.kmax, table, req, n_pages, PAGE, **cfg)
                for L in layers]
    if stage in ("select_top", "select_top_kv"):
        return [lambda s=s: K.select_top(s, n_sel, **cfg) for s in (scores if stage == "select_top" else scores_kv)]
    return [lambda L=L, p=p: K.paged_sparse_decode_attention(q, L.k, L.v, table, req, p, n_rows, PAGE, 0.088,
                                                             aligned=True, **cfg)
            for L, p in zip(layers, picked)]


def layer_fns(cfgs, st, per_kv_head=False):
    """The whole sparse layer as the server runs it: fold the new key, score, select, attend
    (``per_kv_head``: selection over the group-summed scores, the GQA kernel)."""
    from sgl_kernel_sparse import triton_ops as K

    layers, table, q, req, n_rows, n_sel = st[:6]
    n_pages = (n_rows.long() + PAGE - 1) // PAGE
    slot = table[req, n_rows - 1].long()

    def one(L):
        K.quest_fold_decode_keys(L.kmin, L.kmax, L.k[slot], slot, PAGE)
        s = K.quest_page_scores_paged(q, L.kmin, L.kmax, table, req, n_pages, PAGE,
                                      **cfgs["quest_page_scores_paged"])
        if per_kv_head:
            p = K.select_top(quest_pages.group_scores(s, HQ // HKV), n_sel, **cfgs["select_top_kv"])
            return K.paged_gqa_decode_attention(q, L.k, L.v, table, req, p, n_rows, PAGE, 0.088, aligned=True,
                                                **cfgs["paged_gqa_decode_attention"])
        p = K.select_top(s, n_sel, **cfgs["select_top"])
        return K.paged_sparse_decode_attention(q, L.k, L.v, table, req, p, n_rows, PAGE, 0.088, aligned=True,
                                               **cfgs["paged_sparse_decode_attention"])
    return [lambda L=L: one(L) for L in layers]


def make_timer(fns, cuda):
    """A zero-argument callable running every layer's call once: a CUDA graph replay on a GPU."""
    def run_all():
        for f in fns:
            f()
    run_all()  # compile / warm up (outside capture)
    if not cuda:
        return run_all
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_all()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    return graph.replay


def time_us(run, reps, cuda) -> float:
    """Median microseconds of one ``run`` over ``reps``."""
    ts = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        else:
            t = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t) * 1e6)
    return statistics.median(ts)


def agrees(stage, got, want) -> bool:
    if stage.startswith("select_top"):  # page ids: exactly the default's
        return torch.equal(got, want)
    if stage == "quest_page_scores_paged":
        return torch.allclose(got, want, atol=1e-3, rtol=1e-3, equal_nan=True)
    return torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def sweep_stage(stage, configs, st, args, cuda, deadline):
    n_layers = len(st[0])
    rows = []
    want = stage_fns(stage, {}, st)[0]()
    timers = []
    for cfg in configs:
        row = dict(config=cfg)
        try:
            fns = stage_fns(stage, cfg, st)
            row["ok"] = agrees(stage, fns[0](), want)
            timers.append((row, make_timer(fns, cuda)))
        except Exception as exc:  # a config out of registers / shared memory: say so, go on
            row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        rows.append(row)
        if time.monotonic() > deadline:
            print(f"  {stage}: time limit reached after {len(rows)} of {len(configs)} configs", flush=True)
            break
    for _ in range(args.rounds):
        for row, run in timers:
            row.setdefault("rounds_us", []).append(time_us(run, args.reps, cuda) / n_layers)
    for row, _ in timers:
        row["us"] = statistics.median(row["rounds_us"])
    timed = [r for r in rows if r.get("ok") and "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else rows[0]
    return rows, best


# The two served paths of a sparse layer: the kernels each runs and where the table keys them
# (selection by its rows, B x Hq per query head or B x Hkv per KV head; the rest by the batch).
PATHS = {"head": (("quest_page_scores_paged", "quest_page_scores_paged", 1),
                  ("select_top", "select_top", HQ),
                  ("paged_sparse_decode_attention", "paged_sparse_decode_attention", 1)),
         "kv_head": (("quest_page_scores_paged", "quest_page_scores_paged", 1),
                     ("select_top_kv", "select_top", HKV),
                     ("paged_gqa_decode_attention", "paged_gqa_decode_attention", 1))}


def table_entries(batches: dict) -> tuple[dict, list[str]]:
    """The tuning table's kernel entries from each batch's per-stage best configs, kept only where
    the whole sparse layer measured faster with them: a path (``head`` / ``kv_head``) whose tuned
    layer is not faster than its defaults contributes nothing, and an entry that path shares with
    the other (the page scores) goes too. Stages tuned in isolation can lose in the layer (L2 and
    launch interplay), and an entry the server would pick up must not make it slower.

    ``batches``: ``{str(batch): {"best": {stage: config}, "layer_us": {"head_default": us, ...}}}``.
    Selection keys can coincide (batch 1 per query head and batch 4 per KV head are both 32 rows
    of the same pages): the first batch's config that is kept wins. Returns (entries, reasons for
    each dropped entry)."""
    slower = {(b, path) for b, r in batches.items() for path in PATHS
              if r["layer_us"][f"{path}_tuned"] >= r["layer_us"][f"{path}_default"]}
    entries: dict = {}
    dropped = []
    for b, r in batches.items():
        for path, kernels in PATHS.items():
            for stage, kernel, rows_per_req in kernels:
                key = str(int(b) * rows_per_req)
                losers = [p for p in PATHS if (b, p) in slower and any(k[0] == stage for k in PATHS[p])]
                if losers:
                    dropped.append(f"{kernel}[{key}] (batch {b}, {stage}): the tuned layer per "
                                   f"{' and '.join(losers)} was not faster than the defaults")
                    continue
                entries.setdefault(kernel, {}).setdefault(
                    key, {k: v for k, v in r["best"][stage].items() if v is not None})
    return entries, sorted(set(dropped))


def gqa_bytes(b, n_pages) -> int:
    """What HBM must deliver to the GQA kernel per layer: every chosen K and V row once per KV head
    (bf16), a page id and a slot-table entry per page, q read and the output written (split
    partials left out: they stay in L2)."""
    rows = b * HKV * n_pages * PAGE
    return 2 * rows * D * 2 + b * HKV * n_pages * 8 + 2 * b * HQ * D * 2


def fmt(cfg) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--budget", type=int, default=2048, help="Quest's token budget (pages = budget / 16)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers per timed graph (8 x 34 MB > L2)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=480,
                    help="seconds of sweeping, shared evenly by the swept stages of every batch (a stage "
                         "stops adding configs when its share is spent; those it has are still timed)")
    ap.add_argument("--quick", action="store_true", help="a few configs per stage")
    ap.add_argument("--stages", nargs="+", default=None,
                    help="sweep only these stages (the others keep their defaults: {} only)")
    ap.add_argument("--hbm-tbps", type=float, default=None,
                    help="HBM ceiling in TB/s for the GQA kernel's %% of HBM (default: H200 4.8, H100 3.35)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--write-config", default=None, help="write the best configs as a tuning table here")
    ap.add_argument("--write-config-dir", default=None,
                    help="write the tuning table into this folder, named for this GPU (tuning.config_name)")
    args = ap.parse_args()
    grid = grids(args.quick)
    if args.stages:  # checked before anything runs
        unknown = sorted(set(args.stages) - set(grid))
        if unknown:
            ap.error(f"--stages {unknown}: allowed {sorted(grid)}")
        if args.write_config or args.write_config_dir:  # its {} for every other stage would drop their entries
            ap.error("--stages writes no tuning table: leave out --write-config / --write-config-dir")
        grid = {k: (v if k in args.stages else [{}]) for k, v in grid.items()}
    os.environ[tuning.ENV] = "none"  # "default" = the built-in heuristics, not a packaged table
    tuning.clear_cache()
    cuda = torch.cuda.is_available()
    if not cuda:
        from sgl_kernel_sparse.triton_common import interpreting

        if not interpreting():
            print("tune_quest_kernels.py: no CUDA GPU; set TRITON_INTERPRET=1 for a CPU smoke run",
                  file=sys.stderr)
            return 2
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.hbm_tbps is None and cuda:
        args.hbm_tbps = tuning.hbm_tbps(torch.cuda.get_device_name())
    n_sel = max(3, args.budget // PAGE)
    share = args.time_limit / max(1, len(args.batch) * sum(len(c) > 1 for c in grid.values()))
    result = dict(settings=vars(args), device=torch.cuda.get_device_name() if cuda else "cpu (interpreter)",
                  torch=torch.__version__, batches={})
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        pass
    table_out = {"_meta": dict(written_by="benchmark/gpu/tune_quest_kernels.py", device=result["device"],
                               ctx=args.ctx, budget=args.budget, layers=args.layers, rounds=args.rounds,
                               reps=args.reps, date=time.strftime("%Y-%m-%d"))}
    for b in args.batch:
        layers, table, q, req, n_rows = build(b, args.ctx, args.layers, dev, dt)
        scores = [quest_pages.page_scores(q, L.kmin, L.kmax, table, req, n_rows, PAGE) for L in layers]
        picked = [quest_pages.top_pages(s, n_sel) for s in scores]
        scores_kv = [quest_pages.group_scores(s, HQ // HKV) for s in scores]
        picked_kv = [quest_pages.top_pages(s, n_sel) for s in scores_kv]
        st = (layers, table, q, req, n_rows, n_sel, scores, scores_kv, picked, picked_kv)
        res = {}
        best = {}
        for stage, configs in grid.items():
            rows, top = sweep_stage(stage, configs, st, args, cuda, time.monotonic() + share)
            res[stage] = rows
            best[stage] = top["config"]
            base = rows[0].get("us")
            print(f"batch {b} {stage:<31} default {base if base is None else round(base, 1)} us -> best "
                  f"{top.get('us', float('nan')):.1f} us ({fmt(top['config'])}); "
                  f"{sum(1 for r in rows if not r.get('ok'))} configs failed or disagreed", flush=True)
            if stage == "paged_gqa_decode_attention":  # bandwidth on the bytes it must read
                moved = gqa_bytes(b, n_sel)
                for r in rows:
                    if "us" in r:
                        r["gb_per_s"] = moved / r["us"] / 1e3
                        r["pct_hbm"] = 100 * r["gb_per_s"] / (args.hbm_tbps * 1e3) if args.hbm_tbps else None
                if "gb_per_s" in top:
                    print(f"batch {b} {stage}: {moved / 1e6:.1f} MB per layer; default "
                          f"{rows[0].get('gb_per_s', float('nan')):.0f} GB/s, best {top['gb_per_s']:.0f} GB/s"
                          + (f" = {top['pct_hbm']:.0f}% of {args.hbm_tbps} TB/s" if args.hbm_tbps else ""), flush=True)
        layer = {}
        for name, cfgs, per_kv in (("head_default", {s: {} for s in grid}, False), ("head_tuned", best, False),
                                   ("kv_head_default", {s: {} for s in grid}, True), ("kv_head_tuned", best, True)):
            run = make_timer(layer_fns(cfgs, st, per_kv), cuda)
            layer[name] = statistics.median(time_us(run, args.reps, cuda) for _ in range(args.rounds)) / len(layers)
        print(f"batch {b} one sparse layer (us): " + ", ".join(f"{k} {v:.1f}" for k, v in layer.items()), flush=True)
        result["batches"][str(b)] = dict(stages=res, best=best, layer_us=layer)
        Path(args.out).write_text(json.dumps(result, indent=1))  # after every batch: a cut run keeps the rest
        del layers, scores, scores_kv, picked, picked_kv, st
        if cuda:
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    targets = [Path(args.write_config)] if args.write_config else []
    if args.write_config_dir:
        targets.append(Path(args.write_config_dir) / tuning.config_name(result["device"]))
    if targets:  # what the table keeps is said only when one is written
        entries, dropped = table_entries(result["batches"])
        table_out.update(entries)
        table_out["_meta"]["dropped"] = dropped
        for d in dropped:
            print(f"not in the table: {d}")
    for path in targets:
        path.write_text(json.dumps(table_out, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
