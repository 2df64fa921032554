"""Microbenchmark of the sgl_kernel_sparse Triton kernels on one CUDA GPU.

For each kernel and shape: warm-up, then the median of ``--iters`` timed calls (CUDA events
around each call; L2 flushed before each call unless ``--no-flush``), the bytes the kernel
reads and writes (counted from the shapes: every index, KV row, summary and output it touches;
a KV row read by several query heads counts once per head), achieved GB/s and its share of the
HBM ceiling (``--hbm-tbps``, H200: 4.8). The plain-torch reference is timed too (``--no-ref``
to skip). Shapes: a Llama-3-8B-like layer (32 query heads, 8 KV heads, head dim 128).

    python sgl-kernel-sparse/bench/bench_kernels.py --out results.json [--dtype bf16] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402

HQ, HKV, D = 32, 8, 128
DEVICE = "cuda"
# problem sizes (a smoke run on CPU under the Triton interpreter shrinks these)
SIZES = dict(ctx=32768, n_sel=2048, batches=(1, 8, 32), quick_batches=(8,), page=16,
             snap_lens=(8192, 32768), snap_w=32, keep=4096, decode_b=32, decode_ctx=4096)


def parse_args():
    ap = argparse.ArgumentParser(description="sgl_kernel_sparse kernel microbenchmark (CUDA)")
    ap.add_argument("--out", required=True, help="write the results as JSON here")
    ap.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM ceiling in TB/s (H200: 4.8)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode block_n / num_splits")
    ap.add_argument("--no-ref", action="store_true", help="do not time the torch references")
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm between calls")
    return ap.parse_args()


class Timer:
    def __init__(self, warmup, iters, flush):
        self.warmup, self.iters = warmup, iters
        self.scratch = torch.empty(512 * 2**20, dtype=torch.uint8, device=DEVICE) if flush else None

    def __call__(self, fn) -> float:
        """Median milliseconds of one call."""
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if self.scratch is not None:
                self.scratch.zero_()  # evict L2 (50 MB on H200)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_pool(num_slots, dtype, g):
    k = torch.randn(num_slots, HKV, D, generator=g, device=DEVICE).to(dtype)
    v = torch.randn(num_slots, HKV, D, generator=g, device=DEVICE).to(dtype)
    return k, v


def req_table(b, ctx, num_slots, g):
    return torch.randperm(num_slots, generator=g, device=DEVICE)[: b * ctx].view(b, ctx).int()


def splits_bytes(b, num_splits):
    """Split-K partials: written by the first kernel, read by the reduce (fp32 o and lse)."""
    return 0 if num_splits <= 1 else 2 * b * HQ * num_splits * (D + 1) * 4


def decode_cases(dtype, quick, sweep, T, R, g):
    ctx, n_sel = SIZES["ctx"], SIZES["n_sel"]
    for b in SIZES["quick_batches" if quick else "batches"]:
        k, v = kv_pool(b * ctx, dtype, g)
        r2t = req_table(b, ctx, b * ctx, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        # rows: n_sel sorted positions per head (selection output), int32, all valid
        rows = torch.rand(b, HQ, ctx, generator=g, device=DEVICE).argsort(-1)[..., :n_sel]
        rows = rows.sort(-1).values.int()
        valid = torch.ones(b, HQ, n_sel, dtype=torch.bool, device=DEVICE)
        configs = [dict()]
        if sweep:
            configs += [dict(block_n=bn, num_splits=s) for bn in (16, 32, 64) for s in (1, 4, 16)]
        for cfg in configs:
            splits = _decode_splits(T, b, n_sel, q, cfg)
            moved = (nbytes(q, rows, valid, q) + b * HQ * n_sel * 4  # q, rows, valid, out, slots
                     + 2 * b * HQ * n_sel * D * k.element_size() + splits_bytes(b, splits))
            yield dict(
                kernel="sparse_decode_attention", shape=f"B={b} N={n_sel} ctx={ctx}",
                config=cfg or "auto", bytes=moved,
                run=lambda cfg=cfg: T.sparse_decode_attention(q, k, v, r2t, req, rows, valid,
                                                              **cfg),
                ref=None if cfg else (
                    lambda: R.sparse_decode_attention(q, k, v, r2t, req, rows, valid)),
            )
        # Quest-shaped: whole pages (16 tokens), 128 pages per head, same token budget
        page = SIZES["page"]
        n_pages = n_sel // page
        page_ids = torch.rand(b, HQ, ctx // page, generator=g, device=DEVICE).argsort(-1)
        page_ids = page_ids[..., :n_pages].sort(-1).values.int()
        seq = torch.full((b,), ctx - 5, dtype=torch.int32, device=DEVICE)  # partial last page
        splits = _decode_splits(T, b, n_sel, q, {})
        moved = (nbytes(q, page_ids, seq, q) + b * HQ * n_sel * 4
                 + 2 * b * HQ * n_sel * D * k.element_size() + splits_bytes(b, splits))
        yield dict(
            kernel="paged_sparse_decode_attention", shape=f"B={b} pages={n_pages}x{page} ctx={ctx}",
            config="auto", bytes=moved,
            run=lambda: T.paged_sparse_decode_attention(q, k, v, r2t, req, page_ids, seq, page),
            ref=lambda: R.paged_sparse_decode_attention(q, k, v, r2t, req, page_ids, seq, page),
        )


def _decode_splits(T, b, n, q, cfg):
    """The split count the wrapper picks for this call."""
    from sgl_kernel_sparse.triton_decode import plan_splits

    return plan_splits(b * HQ, n, D, q.device, cfg.get("block_n"), cfg.get("num_splits"))[1]


def quest_cases(dtype, quick, T, R, g):
    page, ctx = SIZES["page"], SIZES["ctx"]
    p = ctx // page
    for b in SIZES["quick_batches" if quick else "batches"]:
        kmin = torch.randn(b, p, HKV, D, generator=g, device=DEVICE).to(dtype)
        kmax = kmin + 1
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        n_pages = torch.full((b,), p, dtype=torch.int32, device=DEVICE)
        out_bytes = b * HQ * p * 4
        yield dict(kernel="quest_page_scores", shape=f"B={b} pages={p}", config="auto",
                   bytes=nbytes(kmin, kmax, q, n_pages) + out_bytes,
                   run=lambda: T.quest_page_scores(q, kmin, kmax, n_pages),
                   ref=lambda: R.quest_page_scores(q, kmin, kmax, n_pages))


def snapkv_cases(dtype, quick, T, R, g):
    w = SIZES["snap_w"]
    for length in SIZES["snap_lens"][:1 if quick else None]:
        k = torch.randn(length, HKV, D, generator=g, device=DEVICE).to(dtype)
        q_win = torch.randn(w, HQ, D, generator=g, device=DEVICE).to(dtype)
        n_blocks = -(-length // 64)
        moved = 2 * nbytes(k, q_win) + HKV * length * 4 + 2 * n_blocks * HQ * w * 4
        yield dict(kernel="snapkv_window_scores", shape=f"L={length} W={w}", config="auto",
                   bytes=moved, flops=2 * 2 * w * length * HQ * D,  # two passes of QK^T
                   run=lambda: T.snapkv_window_scores(q_win, k),
                   ref=lambda: R.snapkv_window_scores(q_win, k))


def compact_cases(dtype, quick, T, R, g):
    length, keep = SIZES["ctx"], SIZES["keep"]
    k, v = kv_pool(length + 64, dtype, g)
    src = torch.rand(HKV, length, generator=g, device=DEVICE).argsort(-1)[:, :keep]
    src = src.sort(-1).values
    dst = torch.arange(keep, device=DEVICE)
    rows = keep * HKV * D * k.element_size() * 2  # K and V
    idx = nbytes(src, dst)
    yield dict(kernel="compact_kv", shape=f"{keep} of {length} rows/head", config="overlap-safe",
               bytes=4 * rows + 2 * idx, run=lambda: T.compact_kv(k, v, src, dst),
               ref=lambda: R.compact_kv(k, v, src, dst))
    src2 = src + keep  # sources all past the destinations
    yield dict(kernel="compact_kv", shape=f"{keep} of {length} rows/head", config="assume_disjoint",
               bytes=2 * rows + idx,
               run=lambda: T.compact_kv(k, v, src2, dst, assume_disjoint=True),
               ref=None)


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False "
              "(nothing measured, no JSON written)", file=sys.stderr)
        return 2
    import triton

    from sgl_kernel_sparse import reference as R
    from sgl_kernel_sparse import triton_ops as T

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timer = Timer(args.warmup, args.iters, not args.no_flush)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ceiling = args.hbm_tbps * 1e12
    gens = [decode_cases(dtype, args.quick, args.sweep, T, R, g),
            quest_cases(dtype, args.quick, T, R, g),
            snapkv_cases(dtype, args.quick, T, R, g),
            compact_cases(dtype, args.quick, T, R, g)]
    results = []
    head = (f"{'kernel':<30} {'shape':<30} {'config':<28} {'ms':>8} {'MB':>8} {'GB/s':>8} "
            f"{'%HBM':>6} {'ref ms':>8} {'x ref':>6}")
    print(f"# {torch.cuda.get_device_name()}  dtype={args.dtype}  HBM ceiling {args.hbm_tbps} TB/s")
    print(head)
    print("-" * len(head))
    for gen in gens:
        for case in gen:
            ms = timer(case["run"])
            ref_ms = timer(case["ref"]) if case["ref"] is not None and not args.no_ref else None
            gbps = case["bytes"] / (ms * 1e-3) / 1e9
            row = {k: v for k, v in case.items() if k not in ("run", "ref")}
            row.update(ms=ms, gb_per_s=gbps, pct_hbm=100 * gbps * 1e9 / ceiling, ref_ms=ref_ms,
                       speedup=(ref_ms / ms) if ref_ms else None, config=str(case["config"]))
            if "flops" in case:
                row["tflop_per_s"] = case["flops"] / (ms * 1e-3) / 1e12
            results.append(row)
            ref_s = f"{ref_ms:8.3f} {ref_ms / ms:6.1f}" if ref_ms else f"{'-':>8} {'-':>6}"
            print(f"{row['kernel']:<30} {row['shape']:<30} {row['config']:<28} {ms:8.3f} "
                  f"{case['bytes'] / 1e6:8.1f} {gbps:8.0f} {row['pct_hbm']:6.1f} {ref_s}",
                  flush=True)
    meta = dict(device=torch.cuda.get_device_name(), dtype=args.dtype, hbm_tbps=args.hbm_tbps,
                torch=torch.__version__, triton=triton.__version__, warmup=args.warmup,
                iters=args.iters, l2_flush=not args.no_flush, heads=dict(hq=HQ, hkv=HKV, d=D))
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
