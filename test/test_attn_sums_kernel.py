"""The accumulated-attention kernel (``sgl_kernel_sparse.triton_attn_sums``, H2O / SkipKV / R-KV
prompt scoring) against the plain-torch reference (``eviction_scores.attention_sums``), and the
dispatch ``core.slot_scores`` calls.

CPU, default suite: the kernel under the Triton interpreter in one subprocess
(``python test_attn_sums_kernel.py --interp``; see ``interpreter_cases``), each ``case_*``
reported to its own pytest test: a prompt chunk whose queries are the last rows of the request
(the causal triangle, key blocks that no query block of the chunk sees are skipped), GQA ratios
1 to 4, a padded head dim, queries at scattered rows with weights (R-KV's buffer), fp32 / fp16 /
bf16, non-contiguous q, one query over one key, and the wrapper's refusals. Also CPU: both passes
compiled for sm_90 without a GPU (``bench/compile_report.py``'s compile, in a subprocess).
GPU (``-m gpu``, skipped without CUDA): the compiled kernel on an 8B-shape layer, a chunk of
2,048 queries over 4,096 rows, and the speed of the reference and the kernel side by side.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "sgl-kernel-sparse" / "python") not in sys.path:  # the package from the checkout
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "python"))

from sgl_kernel_sparse import dispatch, eviction_scores  # noqa: E402

from interpreter_cases import compile_report_rows, interpreter_test, report, run_cases  # noqa: E402


def chunk_inputs(n, t, hq, hkv, d, dtype, seed, strided_q=False):
    """A request of ``n`` rows whose last ``t`` are this chunk's queries (rows ``[n - t, n)``).
    Keys spread wide so the sums differ by orders of magnitude across rows."""
    g = torch.Generator().manual_seed(seed)
    keys = (torch.randn(n, hkv, d, generator=g) * 2).to(dtype)
    q = torch.randn(t, hq, d, generator=g) * 2
    if strided_q:  # a view into a wider buffer (as a fused qkv output is)
        q = torch.cat([q, torch.zeros(t, hq, d)], dim=1)[:, :hq]
    return q.to(dtype), keys, torch.arange(n - t, n)


def close(got, want, dtype, what=""):
    # fp16 / bf16: products exact in fp32, only summation order and exp2 vs exp differ
    torch.testing.assert_close(got, want, rtol=2e-4 if dtype != torch.float32 else 1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def _case(T, dtype, n, t, hq, hkv, d, seed, strided_q=False, scale=None, **blocks):
    q, keys, rows = chunk_inputs(n, t, hq, hkv, d, dtype, seed, strided_q)
    want = eviction_scores.attention_sums(q, keys, rows, scale=scale)
    got = T.attention_sums(q, keys, rows, scale=scale, **blocks)
    assert got.shape == (hkv, n) and got.dtype == torch.float32
    close(got, want, dtype, f"{dtype} n={n} t={t} {hq}/{hkv} d={d}")
    # every query's softmax sums to 1: the column sums add up to (queries x group heads)
    torch.testing.assert_close(got.sum(), torch.tensor(float(t * hq)), rtol=1e-4, atol=1e-3)


def case_fp32_gqa2_chunk_triangle(T):
    # 70 rows, the last 40 are the chunk: key blocks of 16 past row 30 are seen by part of it only
    _case(T, torch.float32, 70, 40, 4, 2, 16, 1, block_m=16, block_n=16)


def case_fp32_mha_d48_scale(T):
    _case(T, torch.float32, 37, 37, 3, 3, 48, 2, scale=0.2, block_m=16, block_n=16)


def case_fp16_gqa4_d64_strided_q(T):
    _case(T, torch.float16, 90, 33, 8, 2, 64, 3, strided_q=True, block_m=16, block_n=32)


def case_bf16_gqa3_default_blocks(T):
    _case(T, torch.bfloat16, 130, 70, 6, 2, 32, 4)


def case_one_query_one_key(T):
    _case(T, torch.float32, 1, 1, 2, 1, 16, 5, block_m=16, block_n=16)


def case_scattered_rows_with_weights(T):
    """R-KV's buffer: the counted queries sit at non-contiguous rows, each with its own weight
    (some zero), and rows repeat (two queries of one row, as two heads' buffers)."""
    q, keys, _ = chunk_inputs(60, 9, 4, 2, 16, torch.float32, 6)
    rows = torch.tensor([3, 17, 17, 20, 33, 41, 50, 50, 45])  # no query sees rows past 50
    w = torch.tensor([0.5, 1.0, 0.0, 2.0, 1.0, 0.25, 1.0, 3.0, 1.0])
    want = eviction_scores.attention_sums(q, keys, rows, weights=w)
    got = T.attention_sums(q, keys, rows, weights=w, block_m=16, block_n=16)
    close(got, want, torch.float32, "weighted")
    assert float(got[:, 51:].abs().sum()) == 0.0 and bool((got[:, :51] > 0).all())


def case_unchecked_rows_give_the_same_sums(T):
    """``check_rows_range=False`` (core.slot_scores, whose rows are an arange) skips only the
    range check."""
    q, keys, rows = chunk_inputs(50, 30, 4, 2, 16, torch.float32, 9)
    torch.testing.assert_close(T.attention_sums(q, keys, rows, check_rows_range=False, block_m=16, block_n=16),
                               T.attention_sums(q, keys, rows, block_m=16, block_n=16))


def case_fp8_keys_fp16_and_bf16_queries(T):
    """An fp8 KV cache (``--kv-cache-dtype fp8_e4m3``): the kernel converts each key tile to q's
    dtype as it loads it (exact), so the sums are those of the keys converted first."""
    for dtype, seed, fp8 in ((torch.float16, 10, torch.float8_e4m3fn), (torch.bfloat16, 11, torch.float8_e5m2)):
        q, keys, rows = chunk_inputs(60, 30, 4, 2, 32, dtype, seed)
        keys = keys.to(fp8)
        want = eviction_scores.attention_sums(q, keys.to(dtype), rows)
        close(T.attention_sums(q, keys, rows, block_m=16, block_n=16), want, dtype, f"fp8 {dtype}")


def case_refusals(T):
    q, keys, rows = chunk_inputs(10, 6, 4, 2, 16, torch.float32, 7)
    for bad, why in [(dict(q_rows=rows + 5), "q_rows"), (dict(q_rows=rows - 10), "q_rows"),
                     (dict(keys=keys.half()), "dtype"), (dict(q=q[:, :3]), "multiple"),
                     (dict(weights=torch.ones(5)), "weights")]:
        args = dict(q=q, keys=keys, q_rows=rows) | bad
        try:
            T.attention_sums(**args)
        except ValueError as exc:
            assert why in str(exc), str(exc)
        else:
            raise AssertionError(f"no refusal for {why}")
    empty = T.attention_sums(q[:0], keys, rows[:0])
    assert empty.shape == (2, 10) and float(empty.abs().sum()) == 0.0


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    from sgl_kernel_sparse.triton_attn_sums import attention_sums

    return run_cases(CASES, SimpleNamespace(attention_sums=attention_sums))


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_dispatch_runs_the_reference_on_the_cpu():
    """Off CUDA the dispatch is the reference (what the CPU server's H2O / SkipKV call)."""
    q, keys, rows = chunk_inputs(50, 20, 4, 2, 16, torch.float32, 8)
    torch.testing.assert_close(dispatch.attention_sums(q, keys, rows),
                               eviction_scores.attention_sums(q, keys, rows, block=7))


def _compile_report(out: str) -> None:
    """Subprocess side (``--compile-report OUT``): ``bench/compile_report.py``'s ahead-of-time
    compile for sm_90 of both passes at the 8B shape (bf16 tensor-core dots; fp32 IEEE dots), with
    and without weights; its report as JSON (exit 3: unsupported Triton)."""
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "bench"))
    import compile_report as C
    # imported before compile_all patches triton_common.interpreting (to accept CPU tensors): the
    # wrapper keeps the real one, so bf16 compiles its tensor-core path, not the interpreter's
    from sgl_kernel_sparse.triton_attn_sums import attention_sums

    def exercise(dtypes):
        for dt in dtypes:
            q, keys, rows = chunk_inputs(4096, 2048, 32, 8, 128, dt, 0)
            attention_sums(q, keys, rows)
            attention_sums(q, keys, rows, weights=torch.ones(2048))

    C.EXERCISE["attn_sums"] = exercise
    Path(out).write_text(json.dumps(C.compile_all(90, ["bf16", "fp32"], ["attn_sums"])))


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot see: both passes compile for an H100 / H200 (sm_90), bf16
    (tensor-core dots) and fp32 (IEEE dots), weighted or not; no register spills on the bf16 path,
    none in the sum pass at all."""
    rows = compile_report_rows(__file__, tmp_path / "report.json")
    sums = [r for r in rows if r["kernel"] == "_attn_sums_kernel"]
    assert len(sums) == 4 and {r["kernel"] for r in rows} == {"_attn_sums_kernel", "_kvzip_lse_kernel"}, rows
    served = [r for r in rows if not r["constexprs"]["IEEE"]]  # bf16: what a bf16 model's server runs
    assert len(served) == 4 and all(r["spill_bytes"] == 0 for r in served), served
    # fp32 (IEEE dots, tests and fp32 models only): KVzip's LSE pass spills ~720 bytes, this pass none
    assert all(r["spill_bytes"] == 0 for r in sums), sums


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_attention_sums(dtype):
    """An 8B-shape layer (32 / 8 heads, d 128): a 2,048-query chunk over 4,096 rows, the
    reference (fp32 on the GPU) and the kernel, each timed after a warm-up (printed, not
    asserted)."""
    q, keys, rows = chunk_inputs(4096, 2048, 32, 8, 128, dtype, 11)
    q, keys, rows = q.cuda(), keys.cuda(), rows.cuda()
    timings = {}
    for name, fn in [("reference", lambda: eviction_scores.attention_sums(q, keys, rows)),
                     ("triton", lambda: dispatch.attention_sums(q, keys, rows))]:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(3):
            out = fn()
        torch.cuda.synchronize()
        timings[name] = (time.perf_counter() - t0) / 3 * 1e3
        timings[name + "_out"] = out
    print(f"attention_sums {dtype} 2048 x 4096, 32/8 heads: reference {timings['reference']:.2f} ms, "
          f"triton {timings['triton']:.2f} ms")
    close(timings["triton_out"].cpu(), timings["reference_out"].cpu(), dtype, f"{dtype}")


@pytest.mark.gpu
def test_gpu_attention_sums_fp8_keys():
    """An fp8 KV cache (``--kv-cache-dtype fp8_e4m3``) with bf16 queries: the kernel converts the
    keys to bf16 as it loads them (tensor-core path), the reference upcasts them to fp32."""
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    q, keys, rows = chunk_inputs(1024, 512, 32, 8, 128, torch.bfloat16, 12)
    keys = keys.to(torch.float8_e4m3fn)
    want = eviction_scores.attention_sums(q, keys, rows)
    got = dispatch.attention_sums(q.cuda(), keys.cuda(), rows.cuda())
    close(got.cpu(), want, torch.bfloat16, "fp8 keys")


@pytest.mark.gpu
def test_gpu_attention_sums_other_16bit_keys():
    """An fp16 model with ``--kv-cache-dtype bf16``: the dispatch converts the keys to q's dtype
    before the kernel (the kernel itself takes q's dtype or fp8 only)."""
    q, keys, rows = chunk_inputs(512, 256, 32, 8, 128, torch.float16, 13)
    keys = keys.to(torch.bfloat16)
    want = eviction_scores.attention_sums(q, keys, rows)
    got = dispatch.attention_sums(q.cuda(), keys.cuda(), rows.cuda())
    close(got.cpu(), want, torch.float16, "bf16 keys, fp16 q")


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
elif __name__ == "__main__" and "--compile-report" in sys.argv:
    _compile_report(sys.argv[sys.argv.index("--compile-report") + 1])
