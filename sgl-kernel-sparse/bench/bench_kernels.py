"""Microbenchmark of the sgl_kernel_sparse Triton kernels on one CUDA GPU.

For each kernel and shape: warm-up, then the median of ``--iters`` timed calls (CUDA events
around each call; L2 flushed before each call unless ``--no-flush``), the bytes the kernel
reads and writes (counted from the shapes: every index, KV row, summary and output it touches;
a KV row read by several query heads counts once per head), achieved GB/s and its share of the
HBM ceiling (``--hbm-tbps``; by default the GPU's: H200 4.8, H100 3.35). The plain-torch
reference is timed too (``--no-ref`` to skip). Shapes: a Llama-3-8B-like layer (32 query heads,
8 KV heads, head dim 128).

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
             snap_lens=(8192, 32768), snap_w=32, keep=4096, decode_b=32, decode_ctx=4096,
             # the 32K capacity runs' shapes (benchmark/bench_long_context.py): KIVI 2-bit at its
             # largest resident batch, PyramidKV's per-layer cells at budget 2048
             kivi_batches=(1, 22), kivi_group=32, kivi_res=144, cells_batches=(1, 40), cells_rows=2048,
             # OmniKV at the 128K matched runs: 2,048 chosen rows + 64 generated, logits over the table
             omni_ctx=131072 + 2048, omni_batches=(1, 4), omni_sel=2048, omni_tail=64,
             # H2O / SkipKV prompt chunks at the capacity runs: 8,192 queries over the kept rows
             # (budget 2,048 + interval 32) and the chunk's own
             sums_chunk=8192, sums_held=2080,
             # Quest's served decode step at the 128K matched runs (per-physical-page summaries)
             q128_ctx=131072, q128_batches=(1, 4), q128_sel=2048,
             # the GQA kernel of Quest --sparse-select-per kv_head: the 128K matched shapes, and 32 requests of
             # 32K (issue 4's batch, where enough bytes are in flight to fill HBM)
             gqa_shapes=((131072, 1), (131072, 4), (32768, 32)), gqa_sel=2048)


def parse_args():
    ap = argparse.ArgumentParser(description="sgl_kernel_sparse kernel microbenchmark (CUDA)")
    ap.add_argument("--out", required=True, help="write the results as JSON here")
    ap.add_argument("--hbm-tbps", type=float, default=None,
                    help="HBM ceiling in TB/s (default by the GPU's name: H200 4.8, H100 3.35; else required)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode block_n / num_splits")
    ap.add_argument("--no-ref", action="store_true", help="do not time the torch references")
    ap.add_argument("--no-flush", action="store_true", help="keep L2 warm between calls")
    ap.add_argument("--only", nargs="*", default=None,
                    help="case groups to run (decode quest snapkv compact kivi turboquant palu cells omnikv attn_sums quest128k "
                         "gqa; "
                         "default all)")
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


def kivi_cases(dtype, quick, sweep, T, R, g):
    """KIVI decode (``triton_kivi``): 32K tokens of history in 2- and 4-bit blocks of G plus a
    full-precision residual window, as the server holds them mid-decode."""
    from sgl_kernel_sparse import quant as Q
    from sgl_kernel_sparse.triton_kivi import kivi_decode_attention, plan_kivi_splits

    G, res, ctx = SIZES["kivi_group"], SIZES["kivi_res"], SIZES["ctx"]
    for bits in ((2,) if quick else (2, 4)):
        for b in SIZES["kivi_batches"][-1:] if quick else SIZES["kivi_batches"]:
            nb = (ctx - res) // G
            blocks = []  # quantize in chunks: the fp32 source of 22 x 32K tokens is ~3 GB per tensor
            for i in range(0, b * nb, 2048):
                n = min(2048, b * nb - i)
                x = torch.randn(n * G, HKV, D, generator=g, device=DEVICE)
                blocks.append(Q.kivi_quantize_keys(x, bits, G) + Q.kivi_quantize_values(x, bits, G))
            kc, ks, km, vc, vs, vm = (torch.cat([blk[i] for blk in blocks]) for i in range(6))
            del blocks
            table = torch.randperm(b * nb, generator=g, device=DEVICE).view(b, nb).int()
            k, v = kv_pool(b * res, dtype, g)
            r2t = req_table(b, res, b * res, g)
            req = torch.arange(b, device=DEVICE, dtype=torch.int32)
            n_blocks = torch.full((b,), nb, dtype=torch.int32, device=DEVICE)
            res_len = torch.full((b,), res, dtype=torch.int32, device=DEVICE)
            q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
            splits = plan_kivi_splits(b * HKV, nb, q.device)
            per_block = (kc[0].numel() + vc[0].numel() + (ks[0].numel() + km[0].numel() + vs[0].numel()
                         + vm[0].numel()) * ks.element_size())
            moved = (b * nb * per_block + b * nb * 4 + 2 * b * res * HKV * D * k.element_size()
                     + b * res * 4 + 2 * nbytes(q) + splits_bytes(b, splits))
            args = (q, kc, ks, km, vc, vs, vm, table, req, n_blocks, k, v, r2t, res_len, bits, G)
            configs = [dict()]
            if sweep and b > 1:  # dot operand dtype, splits
                configs += [dict(dot16=False), dict(num_splits=2 * splits), dict(num_splits=4 * splits)]
            for cfg in configs:
                s_cfg = cfg.get("num_splits", splits)
                yield dict(kernel="kivi_decode_attention", shape=f"B={b} {bits}-bit ctx={ctx} G={G}",
                           config=f"{cfg or 'auto'} S={s_cfg}",
                           bytes=moved - splits_bytes(b, splits) + splits_bytes(b, s_cfg),
                           run=lambda args=args, cfg=cfg: kivi_decode_attention(*args, **cfg),
                           ref=None if b > 1 or cfg else (lambda args=args: Q.kivi_decode_attention(*args)))


def turboquant_cases(dtype, quick, sweep, T, R, g):
    """TurboQuant decode (``triton_turboquant``): KIVI's shape (32K tokens of history in blocks of
    G plus a full-precision residual window) with 2-, 3- and 4-bit codes + fp16 norms."""
    from sgl_kernel_sparse import turboquant as TQ
    from sgl_kernel_sparse.triton_kivi import plan_kivi_splits
    from sgl_kernel_sparse.triton_turboquant import turboquant_decode_attention

    G, res, ctx = SIZES["kivi_group"], SIZES["kivi_res"], SIZES["ctx"]
    rot = TQ.rotation(D, 0, device=DEVICE)
    for bits in ((3,) if quick else (2, 3, 4)):
        cb = TQ.codebook(bits, D, device=DEVICE)
        for b in SIZES["kivi_batches"][-1:] if quick else SIZES["kivi_batches"]:
            nb = (ctx - res) // G
            # random codes and norms: the kernel's work does not depend on their values
            kc, vc = (torch.randint(0, 256, (b * nb, HKV, G, D * bits // 8), generator=g, device=DEVICE,
                                    dtype=torch.uint8) for _ in range(2))
            kn, vn = (torch.rand(b * nb, HKV, G, generator=g, device=DEVICE).half() + 0.5 for _ in range(2))
            table = torch.randperm(b * nb, generator=g, device=DEVICE).view(b, nb).int()
            k, v = kv_pool(b * res, dtype, g)
            r2t = req_table(b, res, b * res, g)
            req = torch.arange(b, device=DEVICE, dtype=torch.int32)
            n_blocks = torch.full((b,), nb, dtype=torch.int32, device=DEVICE)
            res_len = torch.full((b,), res, dtype=torch.int32, device=DEVICE)
            q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
            splits = plan_kivi_splits(b * HKV, nb, q.device)
            per_block = kc[0].numel() + vc[0].numel() + 2 * kn[0].numel() * kn.element_size()
            moved = (b * nb * per_block + b * nb * 4 + 2 * b * res * HKV * D * k.element_size()
                     + b * res * 4 + 2 * nbytes(q) + splits_bytes(b, splits))
            args = (q, kc, kn, vc, vn, rot, cb, cb, table, req, n_blocks, k, v, r2t, res_len, bits)
            configs = [dict()]
            if sweep and b > 1:  # dot operand dtype, splits, pipelining depth (shared memory at
                # fp16 on sm_90: 74 KB at Triton's default, 42 KB at 2 stages, 25 KB at 1)
                configs += [dict(dot16=False), dict(num_splits=2 * splits), dict(num_splits=4 * splits),
                            dict(num_stages=1), dict(num_stages=2)]
            for cfg in configs:
                s_cfg = cfg.get("num_splits", splits)
                yield dict(kernel="turboquant_decode_attention", shape=f"B={b} {bits}-bit ctx={ctx} G={G}",
                           config=f"{cfg or 'auto'} S={s_cfg}",
                           bytes=moved - splits_bytes(b, splits) + splits_bytes(b, s_cfg),
                           run=lambda args=args, cfg=cfg: turboquant_decode_attention(*args, **cfg),
                           ref=None if b > 1 or cfg else (lambda args=args: TQ.turboquant_decode_attention(*args)))


def palu_cases(dtype, quick, sweep, T, R, g):
    """Palu decode (``triton_palu``) at ratio 0.5 per head (g 1: r = D/2 = 64, 8 latent groups),
    KIVI's shape (32K tokens of history in blocks of G = 32 plus a full-precision residual window).
    Bytes: latents (K and V, in the pool dtype), residual rows, factors (fp32, counted once), the
    tables, q and the output; not the RoPE table's rows (fp32, shared by every request and head:
    L2 serves most of them), so GB/s is what the method's own data asks of HBM."""
    import triton

    from sgl_kernel_sparse import palu as P
    from sgl_kernel_sparse.triton_kivi import plan_kivi_splits
    from sgl_kernel_sparse.triton_palu import palu_decode_attention

    G, res, ctx, rank = SIZES["kivi_group"], SIZES["kivi_res"], SIZES["ctx"], D // 2
    nb = (ctx - res) // G
    inv = 10000.0 ** (-torch.arange(0, D, 2, device=DEVICE, dtype=torch.float32) / D)
    ang = torch.arange(nb * G, device=DEVICE, dtype=torch.float32)[:, None] * inv[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)  # [positions, D]
    bk, bv = (torch.randn(HKV, rank, D, generator=g, device=DEVICE) / rank**0.5 for _ in range(2))
    for b in SIZES["kivi_batches"][-1:] if quick else SIZES["kivi_batches"]:
        lat_k, lat_v = (torch.randn(b * nb, HKV, G, rank, generator=g, device=DEVICE).to(dtype) for _ in range(2))
        table = torch.randperm(b * nb, generator=g, device=DEVICE).view(b, nb).int()
        k, v = kv_pool(b * res, dtype, g)
        r2t = req_table(b, res, b * res, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        n_blocks = torch.full((b,), nb, dtype=torch.int32, device=DEVICE)
        res_len = torch.full((b,), res, dtype=torch.int32, device=DEVICE)
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        splits = plan_kivi_splits(b * HKV, triton.cdiv(nb * G, 32), q.device)
        moved = (nbytes(lat_k, lat_v, bk, bv) + b * nb * 4 + 2 * b * res * HKV * D * k.element_size()
                 + b * res * 4 + 2 * nbytes(q) + splits_bytes(b, splits))
        args = (q, lat_k, lat_v, bk, bv, None, None, cos_sin, True, table, req, n_blocks, k, v, r2t, res_len)
        configs = [dict()]
        if sweep and b > 1:  # dot operand dtype, warps, token tile, splits
            configs += [dict(dot16=False), dict(num_warps=4), dict(block_n=64), dict(block_n=16),
                        dict(num_splits=2 * splits)]
        for cfg in configs:
            s_cfg = cfg.get("num_splits", splits)
            yield dict(kernel="palu_decode_attention", shape=f"B={b} r={rank} ctx={ctx} G={G}",
                       config=f"{cfg or 'auto'} S={s_cfg}",
                       bytes=moved - splits_bytes(b, splits) + splits_bytes(b, s_cfg),
                       run=lambda args=args, cfg=cfg: palu_decode_attention(*args, **cfg),
                       ref=None if b > 1 or cfg else (lambda args=args: P.palu_decode_attention(*args)))


def cells_cases(dtype, quick, T, R, g):
    """PyramidKV decode over per-layer cells (``triton_cells``): layer 1 of two, each request
    with ``cells_rows`` packed rows in that layer (scattered over the layer's part of the flat
    pool) and 64 decoded rows after them."""
    rows, tail, layers = SIZES["cells_rows"], 64, 2
    for b in SIZES["cells_batches"][-1:] if quick else SIZES["cells_batches"]:
        kp = 2 * rows  # packed engine rows per request (the longest layer's budget)
        per_req = kp + tail
        slots = b * per_req
        flat_k, flat_v = kv_pool(layers * slots, dtype, g)
        r2t = req_table(b, per_req, slots, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        seq = torch.full((b,), per_req, dtype=torch.int32, device=DEVICE)
        count = torch.tensor([[kp, rows]] * b, dtype=torch.int32, device=DEVICE)
        offset = torch.tensor([[0, kp]] * b, dtype=torch.int32, device=DEVICE)
        packed = torch.full((b,), kp, dtype=torch.int32, device=DEVICE)
        entries = torch.zeros(layers * slots, dtype=torch.int32, device=DEVICE)
        for i in range(b):  # layer 1's entries e in [kp, kp + rows): stored at slots + r2t[i, e - kp]
            own = r2t[i, :kp].long()
            pick = own[torch.randperm(kp, generator=g, device=DEVICE)[:rows]].sort().values
            entries[slots + r2t[i, :rows].long()] = (slots + pick).int()
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        n = rows + tail
        moved = (2 * nbytes(q) + b * n * 4 * 2 + 2 * b * HQ * n * D * flat_k.element_size()
                 + splits_bytes(b, 1))
        args = (q, flat_k, flat_v, r2t, req, seq, entries, offset, count, packed, 1, slots)
        yield dict(kernel="cells_decode_attention", shape=f"B={b} rows={n}", config="auto", bytes=moved,
                   run=lambda args=args: T.cells_decode_attention(*args),
                   ref=lambda args=args: R.cells_decode_attention(*args))


def omnikv_cases(dtype, quick, T, R, g):
    """OmniKV's two decode kernels (``triton_omnikv``). Bytes count what HBM must deliver: each
    KV row once per KV head (the query heads of a group share a request's chosen rows, so a
    per-query-head count would overstate the traffic 4x), the slot-table entries, the outputs."""
    ctx, n_sel, tail = SIZES["omni_ctx"], SIZES["omni_sel"], SIZES["omni_tail"]
    for b in SIZES["omni_batches"][-1:] if quick else SIZES["omni_batches"]:
        k, v = kv_pool(b * ctx, dtype, g)
        r2t = req_table(b, ctx, b * ctx, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        seq = torch.full((b,), ctx - 2048, dtype=torch.int32, device=DEVICE)  # 128K resident rows
        t0 = seq - tail
        sel = torch.rand(b, int(t0[0]), generator=g, device=DEVICE).argsort(-1)[:, :n_sel].sort(-1).values.int()
        n = n_sel + tail
        moved = 2 * nbytes(q) + b * n * 4 * 2 + 2 * b * HKV * n * D * k.element_size()
        yield dict(kernel="rows_tail_decode_attention", shape=f"B={b} rows={n_sel}+{tail}", config="auto",
                   bytes=moved, run=lambda a=(q, k, v, r2t, req, sel, t0, seq): T.rows_tail_decode_attention(*a),
                   ref=lambda a=(q, k, v, r2t, req, sel, t0, seq): R.rows_tail_decode_attention(*a))
        moved = nbytes(q) + b * int(seq[0]) * (4 + HKV * D * k.element_size()) + b * HQ * ctx * 4
        yield dict(kernel="token_logits", shape=f"B={b} rows={int(seq[0])} width={ctx}", config="auto",
                   bytes=moved, run=lambda a=(q, k, r2t, req, seq): T.token_logits(*a),
                   ref=None)


def paged_table(b, ctx, page, g):
    """A slot table whose pages are whole, aligned pool pages in random order (SGLang with
    ``--page-size``): row-page p of request b is pool page ``perm[b * P + p]``."""
    n_pages = ctx // page
    perm = torch.randperm(b * n_pages, generator=g, device=DEVICE).view(b, n_pages, 1)
    return (perm * page + torch.arange(page, device=DEVICE)).view(b, ctx).int()


def quest128k_cases(dtype, quick, sweep, T, R, g):
    """One sparse layer of Quest's served decode step at 128K, kernel by kernel, in the order the
    server runs them (``kernels/quest_pages``): fold the new keys into their pages' summaries,
    score every page from the per-physical-page summaries, pick the top pages per query head
    (``select_top``), attend over them. Bytes: each page summary once per KV head (one tile
    scores the group's query heads), each chosen KV row once per query head (each head reads its
    own pages), the table entries, the scores written and read. ``sweep``: the paged attention
    also at each ``block_n`` x ``num_splits`` (its default is not tuned for 128K)."""
    ctx, page, n_sel = SIZES["q128_ctx"], SIZES["page"], SIZES["q128_sel"]
    n_pages, k_pages = ctx // page, n_sel // page
    for b in SIZES["q128_batches"][-1:] if quick else SIZES["q128_batches"]:
        k, v = kv_pool(b * ctx, dtype, g)
        kmin = torch.randn(b * n_pages, HKV, D, generator=g, device=DEVICE).to(dtype)
        kmax = kmin + 1
        r2t = paged_table(b, ctx, page, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        seq = torch.full((b,), ctx - 5, dtype=torch.int32, device=DEVICE)  # partial last page
        have = torch.full((b,), n_pages, dtype=torch.int32, device=DEVICE)
        new_k = torch.randn(b, HKV, D, generator=g, device=DEVICE).to(dtype)
        new_slots = r2t[:, -5].contiguous()
        yield dict(kernel="quest_fold_decode_keys", shape=f"B={b} page={page}", config="auto",
                   bytes=nbytes(new_k) + 4 * b * HKV * D * kmin.element_size(),
                   run=lambda a=(kmin, kmax, new_k, new_slots, page): T.quest_fold_decode_keys(*a), ref=None)
        scores = T.quest_page_scores_paged(q, kmin, kmax, r2t, req, have, page)
        yield dict(kernel="quest_page_scores_paged", shape=f"B={b} pages={n_pages}", config="auto",
                   bytes=2 * b * n_pages * HKV * D * kmin.element_size() + b * n_pages * 4 + nbytes(q, scores),
                   run=lambda a=(q, kmin, kmax, r2t, req, have, page): T.quest_page_scores_paged(*a),
                   ref=lambda a=(q, kmin, kmax, r2t, req, have, page): R.quest_page_scores_paged(*a))
        yield dict(kernel="select_top", shape=f"B={b} Hq={HQ} P={n_pages} k={k_pages}", config="auto",
                   bytes=nbytes(scores) + b * HQ * k_pages * 8,
                   run=lambda: T.select_top(scores, k_pages), ref=lambda: R.quest_select_pages(scores, k_pages))
        page_ids = T.select_top(scores, k_pages)
        configs = [dict()]
        if sweep:
            configs += [dict(block_n=bn, num_splits=s) for bn in (32, 64, 128) for s in (4, 8, 16, 32)]
        for cfg in configs:
            splits = _decode_splits(T, b, n_sel, q, cfg)
            yield dict(kernel="paged_sparse_decode_attention", shape=f"B={b} pages={k_pages}x{page} ctx={ctx}",
                       config=cfg or "auto", bytes=nbytes(q, page_ids, seq, q) + b * HQ * n_sel * 4
                       + 2 * b * HQ * n_sel * D * k.element_size() + splits_bytes(b, splits),
                       run=lambda cfg=cfg, a=(q, k, v, r2t, req, page_ids, seq, page):
                       T.paged_sparse_decode_attention(*a, **cfg),
                       ref=None)


GQA_VARIANTS = {"plain": dict(prefetch=False), "prefetch": dict(prefetch=True)}


def gqa_cases(dtype, quick, sweep, T, R, g):
    """``paged_gqa_decode_attention`` (Quest ``--sparse-select-per kv_head``) on aligned pages of 16:
    ``gqa_sel`` rows per KV head, each page read once for its group. Bytes count what HBM must
    deliver: each chosen KV row once per KV head, one table entry and one page id per page (read
    by every row of the page, but from the same line), q and the output, the split partials. The
    launch variants (``GQA_VARIANTS``: a plain loop, the next tile's slots ahead: the default) at
    the wrapper's split / tile choice; ``sweep``: also at each split count x tile."""
    from sgl_kernel_sparse.triton_decode import plan_splits

    page, n_sel = SIZES["page"], SIZES["gqa_sel"]
    k_pages = n_sel // page
    shapes = SIZES["gqa_shapes"][1:2] if quick else SIZES["gqa_shapes"]
    for ctx, b in shapes:
        k, v = kv_pool(b * ctx, dtype, g)
        r2t = paged_table(b, ctx, page, g)
        req = torch.arange(b, device=DEVICE, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=g, device=DEVICE).to(dtype)
        seq = torch.full((b,), ctx - 5, dtype=torch.int32, device=DEVICE)
        # k_pages distinct pages per (request, KV head), sorted as select_top leaves them
        page_ids = torch.rand(b, HKV, ctx // page - 1, generator=g, device=DEVICE).argsort(-1)[..., :k_pages]
        page_ids = page_ids.sort(-1).values.int()
        grid = [(None, None)]
        if sweep:
            grid += [(s, bn) for s in (4, 8, 16, 32, 64) for bn in (16, 32, 64)]
        for splits, block_n in grid:
            for name, opts in GQA_VARIANTS.items():
                cfg = dict(num_splits=splits, block_n=block_n, **opts)
                n_split = plan_splits(b * HKV, n_sel, D, q.device, max(16, block_n or 32), splits)[1]
                moved = (2 * nbytes(q) + b * HKV * k_pages * 8 + 2 * b * HKV * n_sel * D * k.element_size()
                         + splits_bytes(b, n_split))
                shown = {k_: v_ for k_, v_ in cfg.items() if v_ is not None} or "auto"
                yield dict(kernel="paged_gqa_decode_attention", shape=f"B={b} {k_pages}x{page}/KVh ctx={ctx}",
                           config=shown, bytes=moved, variant=name, splits=n_split,
                           run=lambda cfg=cfg, a=(q, k, v, r2t, req, page_ids, seq, page):
                           T.paged_gqa_decode_attention(*a, aligned=True, **cfg),
                           ref=None)


def attn_sums_cases(dtype, quick, T, R, g):
    """Accumulated attention of a prompt chunk (``triton_attn_sums``, H2O / SkipKV / R-KV). It is
    compute-bound: ``flops`` counts both passes' ``QK^T`` over the whole chunk x rows rectangle
    (the causal triangle the kernel skips is counted too: an upper bound); bytes count q, the
    keys once per pass and the output."""
    from sgl_kernel_sparse import eviction_scores

    t = SIZES["sums_chunk"]
    n = t + SIZES["sums_held"]
    k = torch.randn(n, HKV, D, generator=g, device=DEVICE).to(dtype)
    q = torch.randn(t, HQ, D, generator=g, device=DEVICE).to(dtype)
    rows = torch.arange(n - t, n, device=DEVICE)
    moved = 2 * nbytes(q, k) + HKV * n * 4 + HQ * t * 4 * 2
    yield dict(kernel="attention_sums", shape=f"S={t} N={n}", config="auto", bytes=moved,
               flops=2 * 2 * t * n * HQ * D, run=lambda: T.attention_sums(q, k, rows),
               ref=lambda: eviction_scores.attention_sums(q, k, rows))


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False "
              "(nothing measured, no JSON written)", file=sys.stderr)
        return 2
    import triton

    from sgl_kernel_sparse import reference as R
    from sgl_kernel_sparse import triton_ops as T
    from sgl_kernel_sparse.tuning import hbm_tbps

    if args.hbm_tbps is None:
        name = torch.cuda.get_device_name()
        args.hbm_tbps = hbm_tbps(name)
        if args.hbm_tbps is None:
            print(f"--hbm-tbps: no default for {name!r}; pass this GPU's HBM ceiling in TB/s", file=sys.stderr)
            return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    timer = Timer(args.warmup, args.iters, not args.no_flush)
    g = torch.Generator(device=DEVICE).manual_seed(0)
    ceiling = args.hbm_tbps * 1e12
    groups = {"decode": lambda: decode_cases(dtype, args.quick, args.sweep, T, R, g),
              "quest": lambda: quest_cases(dtype, args.quick, T, R, g),
              "snapkv": lambda: snapkv_cases(dtype, args.quick, T, R, g),
              "compact": lambda: compact_cases(dtype, args.quick, T, R, g),
              "kivi": lambda: kivi_cases(dtype, args.quick, args.sweep, T, R, g),
              "turboquant": lambda: turboquant_cases(dtype, args.quick, args.sweep, T, R, g),
              "palu": lambda: palu_cases(dtype, args.quick, args.sweep, T, R, g),
              "cells": lambda: cells_cases(dtype, args.quick, T, R, g),
              "omnikv": lambda: omnikv_cases(dtype, args.quick, T, R, g),
              "attn_sums": lambda: attn_sums_cases(dtype, args.quick, T, R, g),
              "quest128k": lambda: quest128k_cases(dtype, args.quick, args.sweep, T, R, g),
              "gqa": lambda: gqa_cases(dtype, args.quick, args.sweep, T, R, g)}
    unknown = set(args.only or ()) - set(groups)
    if unknown:
        print(f"--only: unknown group(s) {sorted(unknown)}; allowed: {sorted(groups)}", file=sys.stderr)
        return 2
    gens = [make() for name, make in groups.items() if args.only is None or name in args.only]
    results = []
    head = (f"{'kernel':<30} {'shape':<30} {'config':<40} {'ms':>8} {'MB':>8} {'GB/s':>8} "
            f"{'%HBM':>6} {'ref ms':>8} {'x ref':>6}")
    print(f"# {torch.cuda.get_device_name()}  dtype={args.dtype}  HBM ceiling {args.hbm_tbps} TB/s")
    print(head)
    print("-" * len(head))
    for gen in gens:
        for case in gen:
            try:
                ms = timer(case["run"])
            except Exception as err:  # e.g. a sweep config out of shared memory: say so, go on
                print(f"{case['kernel']:<30} {case['shape']:<30} {str(case['config']):<40} failed: "
                      f"{type(err).__name__}: {str(err).splitlines()[0][:120]}", flush=True)
                results.append(dict(kernel=case["kernel"], shape=case["shape"], config=str(case["config"]),
                                    error=f"{type(err).__name__}: {err}"))
                continue
            ref_ms = timer(case["ref"]) if case["ref"] is not None and not args.no_ref else None
            gbps = case["bytes"] / (ms * 1e-3) / 1e9
            row = {k: v for k, v in case.items() if k not in ("run", "ref")}
            row.update(ms=ms, gb_per_s=gbps, pct_hbm=100 * gbps * 1e9 / ceiling, ref_ms=ref_ms,
                       speedup=(ref_ms / ms) if ref_ms else None, config=str(case["config"]))
            if "flops" in case:
                row["tflop_per_s"] = case["flops"] / (ms * 1e-3) / 1e12
            results.append(row)
            ref_s = f"{ref_ms:8.3f} {ref_ms / ms:6.1f}" if ref_ms else f"{'-':>8} {'-':>6}"
            print(f"{row['kernel']:<30} {row['shape']:<30} {row['config']:<40} {ms:8.3f} "
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
