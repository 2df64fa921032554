"""Compile every Triton kernel of sgl_kernel_sparse for an NVIDIA target *without a GPU* and
report registers, spills and shared memory (ptxas -v), one line per kernel variant.

The public wrappers are called on CPU tensors with realistic shapes; the kernel launch is
replaced by an ahead-of-time compile (same signature, constexprs and 16-byte divisibility
specialization a real launch would use). Catches compile errors the interpreter cannot see.

    python sgl-kernel-sparse/bench/compile_report.py [--arch 90] [--json out.json]
        [--groups core,quant] [--ptx-hash]
Kernel groups: ``core`` (decode, Quest, SnapKV, compaction: the default), ``quant`` (KIVI,
TurboQuant, Palu and FP8 decode, ``triton_kivi.py`` / ``triton_turboquant.py`` /
``triton_palu.py`` / ``triton_fp8.py``) and
``prefill`` (FlashPrefill's block-sparse prefill, ``triton_flashprefill.py``);
``--groups core,quant,prefill`` compiles all.
The default stays ``core``: test_sparse_kernels.py checks that exact set of kernel names
(test_quant_kernels.py compiles ``--groups quant``, test_flashprefill_kernels.py ``--groups prefill``).
``--ptx-hash`` adds to each variant a hash of its PTX without the lines that only say where
the source is (``.loc``, ``.file``, debug-only labels, debug sections): equal hashes before and
after a refactor show it changed no kernel, wherever its lines moved.
Exit status 1 if a kernel fails to compile or spills more than --max-spill bytes; 3 if this
triton's internals differ from what the tool drives (written for triton 3.8).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # must compile, not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch  # noqa: E402
import triton  # noqa: E402

try:  # Triton internals this tool drives (checked against triton 3.8)
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, native_specialize_impl
except ImportError as exc:
    print(f"compile_report: unsupported triton {triton.__version__}: {exc}", file=sys.stderr)
    sys.exit(3)

import sgl_kernel_sparse.triton_common as tc  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _ptxas_info(ptx: str, arch: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([str(PTXAS), "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = re.search(r"Used (\d+) registers", res.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0}


_DEBUG_LINE = re.compile(r"\s*(\.loc|\.file)\s|\$L__(tmp|func_begin|func_end)\d+:\s*$")


def ptx_hash(ptx: str) -> str:
    """sha256 (16 hex digits) of the PTX without its source locations: ``.loc`` / ``.file`` lines,
    the labels only the debug info refers to (``$L__tmpN``, ``$L__func_beginN``, ...) and the
    ``.section .debug_*`` blocks (everything from the first one on: they close the file)."""
    keep = []
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug_" in line:
            break
        if not _DEBUG_LINE.match(line):
            keep.append(line)
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


GROUPS = ("core", "quant", "prefill")


def compile_all(arch: int = 90, dtypes=("fp16", "bf16", "fp32"), groups=("core",),
                hash_ptx: bool = False) -> list[dict]:
    """One row per kernel launch the groups' wrappers make; ``hash_ptx``: with ``ptx_hash``."""
    report: list[dict] = []
    target = GPUTarget("cuda", arch, 32)

    def aot_run(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
        sig, consts, attrs = {}, {}, {}
        for i, p in enumerate(self.params):
            val = bound[p.name]
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", val
                continue
            is_float = isinstance(val, float)  # floats are never specialized
            ty, key = native_specialize_impl(BaseBackend, val, False, not is_float, True)
            if ty == "constexpr":  # ints equal to 1 are baked in, as at launch
                sig[p.name], consts[p.name] = "constexpr", key
                continue
            sig[p.name] = ty
            if key == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(ASTSource(self, sig, consts, attrs), target=target, options=options)
        shown = {k: v for k, v in consts.items() if k.isupper() and not k.startswith("BLOCK_D")}
        row = {"kernel": self.fn.__name__, "constexprs": shown,
               "num_warps": kernel.metadata.num_warps, "shared": kernel.metadata.shared,
               **_ptxas_info(kernel.asm["ptx"], arch)}
        if hash_ptx:
            row["ptx_hash"] = ptx_hash(kernel.asm["ptx"])
        report.append(row)

    # Let the wrappers accept CPU tensors: check_device reads triton_common.interpreting at each
    # call. The modules that pick a launch option by interpreting() (bf16 dots off under the
    # interpreter: triton_kivi.plan_tiles for KIVI, TurboQuant and Palu; KVzip) bind the real one
    # when imported, so they are imported first and compile what a GPU launch compiles.
    from sgl_kernel_sparse import triton_kivi, triton_kvzip  # noqa: F401

    real = tc.interpreting
    tc.interpreting = lambda: True
    saved = JITFunction.run
    JITFunction.run = aot_run
    try:
        for group in groups:
            EXERCISE[group]([DTYPES[d] for d in dtypes])
    finally:
        JITFunction.run = saved
        tc.interpreting = real
    return report


def _exercise(dtypes) -> None:
    """Call each wrapper once per kernel variant (shapes as on a Llama-3-8B-like layer)."""
    from sgl_kernel_sparse import triton_ops as T

    b, hq, hkv, d, slots = 4, 32, 8, 128, 4096
    r2t = torch.zeros(b, 1024, dtype=torch.int32)
    req = torch.arange(b, dtype=torch.int32)
    for dt in dtypes:
        q = torch.zeros(b, hq, d, dtype=dt)
        kc = torch.zeros(slots, hkv, d, dtype=dt)
        rows = torch.zeros(b, hq, 512, dtype=torch.int32)
        valid = torch.ones(b, hq, 512, dtype=torch.bool)
        T.sparse_decode_attention(q, kc, kc, r2t, req, rows, valid, num_splits=1)
        T.sparse_decode_attention(q, kc, kc, r2t, req, rows, valid, num_splits=4)
        pages = torch.zeros(b, hq, 32, dtype=torch.int32)
        T.paged_sparse_decode_attention(q, kc, kc, r2t, req, pages, req + 500, 16, num_splits=4)
        # the launch options tune_quest_kernels.py sweeps (Quest's served call passes aligned=True)
        T.paged_sparse_decode_attention(q, kc, kc, r2t, req, pages, req + 500, 16, num_splits=4, aligned=True)
        T.paged_sparse_decode_attention(q, kc, kc, r2t, req, pages, req + 500, 16, num_splits=4, aligned=True,
                                        prefetch=True)
        T.paged_sparse_decode_attention(q, kc, kc, r2t, req, pages, req + 500, 16, num_splits=4, aligned=True,
                                        num_stages=3)
        kv_pages = torch.zeros(b, hkv, 128, dtype=torch.int64)  # Quest --sparse-select-per kv_head
        for splits in (1, 4):
            # dot16: the 16-bit dots served on CUDA (CPU tensors here would pick the interpreter's fp32 dots)
            T.paged_gqa_decode_attention(q, kc, kc, r2t, req, kv_pages, req + 500, 16, num_splits=splits, aligned=True,
                                         dot16=True)
        T.paged_gqa_decode_attention(q, kc, kc, r2t, req, kv_pages, req + 500, 16, num_splits=4, aligned=True,
                                     num_stages=3, dot16=True)
        for prefetch in (False, True):  # (the default: prefetch on unless num_stages is given)
            T.paged_gqa_decode_attention(q, kc, kc, r2t, req, kv_pages, req + 500, 16, num_splits=8, aligned=True,
                                         block_n=32 if dt == torch.float32 else 64, dot16=True, prefetch=prefetch)
        T.snapkv_window_scores(torch.zeros(32, hq, d, dtype=dt), kc)
        T.snapkv_window_scores(torch.zeros(32, hq, d, dtype=dt), kc, slots=torch.arange(100))
        T.compact_kv(kc, kc, torch.zeros(hkv, 100, dtype=torch.int64), torch.arange(100))
        T.compact_kv(kc, kc, torch.zeros(hkv, 100, dtype=torch.int64), torch.arange(100), segment=50)
        kmin = torch.zeros(b, 64, hkv, d, dtype=dt)
        T.quest_page_scores(q, kmin, kmin, req + 10)
        sel = torch.zeros(b, 512, dtype=torch.int32)
        for splits in (1, 4):
            T.rows_tail_decode_attention(q, kc, kc, r2t, req, sel, req + 600, req + 700, num_splits=splits)
        T.token_logits(q, kc, r2t, req, req + 500)
        pk = torch.zeros(slots // 16, hkv, d, dtype=dt)
        T.quest_fold_decode_keys(pk, pk, torch.zeros(b, hkv, d, dtype=dt), req.long() * 16, 16)
    for p in (1024, 8704):  # Quest's pages at 16K and 136K tokens of context, 128 kept
        T.select_top(torch.zeros(b, hq, p), 128)
        T.select_top(torch.zeros(b, hq, p), 128, method="radix")
        for warps in (4, 8, 16, 32):
            T.select_top(torch.zeros(b, hq, p), 128, method="nibble", num_warps=warps)
    if torch.float16 in dtypes:  # fp32 summaries, fp16 queries
        kmin = torch.zeros(b, 64, hkv, d, dtype=torch.float32)
        T.quest_page_scores(torch.zeros(b, hq, d, dtype=torch.float16), kmin, kmin, req + 10)


def _exercise_quant(dtypes) -> None:
    """KIVI (2 and 4 bits, 64 blocks of 32 + residual), TurboQuant (2, 3 and 4 bits, same
    blocks), Palu (ranks 32 to 128, neox / GPT-J RoPE, with and without biases, same blocks) and
    FP8 (per-head and per-tensor scales) decode, with and without split-K; same Llama-3-8B-like
    layer."""
    from sgl_kernel_sparse.triton_fp8 import fp8_decode_attention
    from sgl_kernel_sparse.triton_kivi import kivi_decode_attention
    from sgl_kernel_sparse.triton_palu import palu_decode_attention
    from sgl_kernel_sparse.triton_turboquant import turboquant_decode_attention

    b, hq, hkv, d, slots, group, n_blk = 4, 32, 8, 128, 4096, 32, 256
    r2t = torch.zeros(b, 1024, dtype=torch.int32)
    req = torch.arange(b, dtype=torch.int32)
    table = torch.zeros(b, 64, dtype=torch.int32)
    for bits in (2, 4):
        codes = torch.zeros(n_blk, hkv, group, d * bits // 8, dtype=torch.uint8)
        k_sm = torch.zeros(n_blk, hkv, d)
        v_sm = torch.zeros(n_blk, hkv, group, d // group)
        for dt in dtypes:
            q = torch.zeros(b, hq, d, dtype=dt)
            kc = torch.zeros(slots, hkv, d, dtype=dt)
            for splits in (1, 4):
                kivi_decode_attention(q, codes, k_sm, k_sm, codes, v_sm, v_sm, table, req, req,
                                      kc, kc, r2t, req, bits, group, num_splits=splits)
    rot = torch.zeros(d, d)
    norms = torch.zeros(n_blk, hkv, group, dtype=torch.float16)
    for bits in (2, 3, 4):
        codes = torch.zeros(n_blk, hkv, group, d * bits // 8, dtype=torch.uint8)
        cb = torch.zeros(1 << bits)
        for dt in dtypes:
            q = torch.zeros(b, hq, d, dtype=dt)
            kc = torch.zeros(slots, hkv, d, dtype=dt)
            for splits in (1, 4):
                turboquant_decode_attention(q, codes, norms, codes, norms, rot, cb, cb, table, req, req,
                                            kc, kc, r2t, req, bits, num_splits=splits)
    # (latent groups, rank, rotary_dim, neox, biases); fp32 (3xTF32 dots) spills from rank 64 on
    # (~320 bytes at 4 warps), so only rank 32 compiles in fp32
    for ng, rank, rd, neox, bias in ((8, 64, 128, True, False), (8, 64, 128, False, True),
                                     (4, 128, 128, True, False), (8, 32, 64, True, True)):
        fac = torch.zeros(ng, rank, hkv // ng * d)
        bi = torch.zeros(hkv * d) if bias else None
        for dt in dtypes:
            if dt == torch.float32 and rank >= 64:
                continue
            q = torch.zeros(b, hq, d, dtype=dt)
            lat = torch.zeros(n_blk, ng, group, rank, dtype=dt)
            kc = torch.zeros(slots, hkv, d, dtype=dt)
            for splits in (1, 4):
                palu_decode_attention(q, lat, lat, fac, fac, bi, bi, torch.zeros(slots, rd), neox, table, req,
                                      req, kc, kc, r2t, req, num_splits=splits)
    k8 = torch.zeros(slots, hkv, d, dtype=torch.float8_e4m3fn)
    for dt in dtypes:
        q = torch.zeros(b, hq, d, dtype=dt)
        for sc in (torch.ones(hkv), torch.ones(1)):
            for splits in (1, 4):
                fp8_decode_attention(q, k8, k8, sc, sc, r2t, req, req + 500, num_splits=splits)


def _exercise_prefill(dtypes) -> None:
    """FlashPrefill's block-sparse prefill (``triton_flashprefill.py``): a 2K-token chunk after
    2K tokens of context, blocks of 64 and 128, keep-all mask (the mask does not change the code).
    fp16 / bf16 only: fp32 (exact IEEE dots, for the interpreter tests) spills at these tiles and
    the dispatch sends fp32 to the reference."""
    from sgl_kernel_sparse.flashprefill import keep_all_mask
    from sgl_kernel_sparse.triton_flashprefill import block_sparse_attention

    s, start, hq, hkv, d = 2048, 2048, 32, 8, 128
    for dt in (dt for dt in dtypes if dt != torch.float32):
        q = torch.zeros(s, hq, d, dtype=dt)
        kv = torch.zeros(start + s, hkv, d, dtype=dt)
        for block in (64, 128):
            block_sparse_attention(q, kv, kv, keep_all_mask(s, hq, block, start), block, start)


EXERCISE = {"core": _exercise, "quant": _exercise_quant, "prefill": _exercise_prefill}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="SM version (90 = H100/H200)")
    ap.add_argument("--dtypes", default="fp16,bf16,fp32", help="comma list of fp16,bf16,fp32")
    ap.add_argument("--max-spill", type=int, default=64,
                    help="fail above this many spill bytes (ptxas sometimes spills a few bytes "
                         "well below the register limit; harmless)")
    ap.add_argument("--groups", default="core",
                    help=f"comma list of kernel groups {','.join(GROUPS)} (default: core)")
    ap.add_argument("--json", help="also write the report here")
    ap.add_argument("--ptx-hash", action="store_true",
                    help="add a hash of each variant's PTX without source locations (see ptx_hash)")
    args = ap.parse_args()
    groups = args.groups.split(",")
    if not set(groups) <= set(GROUPS):
        ap.error(f"--groups: unknown {sorted(set(groups) - set(GROUPS))}")
    try:
        report = compile_all(args.arch, args.dtypes.split(","), groups, args.ptx_hash)
    except Exception as exc:  # a compile error: say which, fail
        print(f"compile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    seen = set()
    for r in report:
        key = json.dumps(r, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        print(f"{r['kernel']:<24} warps={r['num_warps']} regs={r['registers']:>3} "
              f"spill={r['spill_bytes']:>4}B smem={r['shared']:>6}B {r['constexprs']}"
              + (f" ptx={r['ptx_hash']}" if "ptx_hash" in r else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    spilled = [r["kernel"] for r in report if r["spill_bytes"] > args.max_spill]
    if spilled:
        print(f"register spills in: {sorted(set(spilled))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
