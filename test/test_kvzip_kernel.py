"""KVzip's probe-score kernel (``sgl_kernel_sparse.triton_kvzip``) against the plain-torch
reference (``reference.kvzip_probe_scores``), and the dispatch the method calls.

CPU, default suite: the kernel under the Triton interpreter in one subprocess
(``python test_kvzip_kernel.py --interp``; see ``interpreter_cases``), each ``case_*`` reported
to its own pytest test: GQA ratios 1 to 4, head dims 16 to 64 (and 48: a padded D), probe blocks
that span key tiles and context lengths off the tile size, probe positions with gaps (a
continuation's rows), fp32 / fp16 / bf16, non-contiguous q, and the wrapper's refusals.
GPU (``-m gpu``, skipped without CUDA): the compiled kernel on a layer of the 8B shape.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "sgl-kernel-sparse" / "python") not in sys.path:  # the package from the checkout
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "python"))

from sgl_kernel_sparse import dispatch, reference  # noqa: E402

from interpreter_cases import interpreter_test, report, run_cases  # noqa: E402


def probe_inputs(c, s, hq, hkv, d, dtype, seed, gap=0, strided_q=False):
    """A context of ``c`` keys then ``s`` probe keys (plus ``gap`` rows between: resumed rows of a
    continuation the probe also sees), the probe's queries at positions ``[c + gap, c + gap + s)``.
    Keys spread wide enough that the max-probabilities differ by orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    n = c + gap + s
    keys = (torch.randn(n, hkv, d, generator=g) * 2).to(dtype)
    q = (torch.randn(s, hq, d, generator=g) * 2)
    if strided_q:  # a view into a wider buffer (as a fused qkv output is)
        q = torch.cat([q, torch.zeros(s, hq, d)], dim=1)[:, :hq]
    q = q.to(dtype)
    pos = torch.arange(c + gap, n)
    return q, keys, pos


def close(got, want, dtype, what=""):
    # fp16 / bf16 inputs: products exact in fp32, only summation order and exp2 vs exp differ
    torch.testing.assert_close(got, want, rtol=2e-4 if dtype != torch.float32 else 1e-5, atol=1e-7,
                               msg=lambda m: f"{what}: {m}")


def _case(T, dtype, c, s, hq, hkv, d, seed, gap=0, strided_q=False, scale=None, **blocks):
    q, keys, pos = probe_inputs(c, s, hq, hkv, d, dtype, seed, gap, strided_q)
    want = reference.kvzip_probe_scores(q, keys, pos, c, scale)
    got = T.kvzip_probe_scores(q, keys, pos, c, scale=scale, **blocks)
    assert got.shape == (hkv, c) and got.dtype == torch.float32
    close(got, want, dtype, f"{dtype} c={c} s={s} {hq}/{hkv} d={d}")


def case_fp32_gqa2_tiles_span(T):
    _case(T, torch.float32, 40, 37, 4, 2, 16, 1, block_m=16, block_n=16)


def case_fp32_mha_d48_gap_scale(T):
    _case(T, torch.float32, 19, 21, 3, 3, 48, 2, gap=11, scale=0.2, block_m=16, block_n=16)


def case_fp16_gqa4_d64_strided_q(T):
    _case(T, torch.float16, 70, 33, 8, 2, 64, 3, strided_q=True, block_m=16, block_n=32)


def case_bf16_gqa3_default_blocks(T):
    _case(T, torch.bfloat16, 65, 64, 6, 2, 32, 4)


def case_context_of_one_and_probe_of_one(T):
    _case(T, torch.float32, 1, 1, 2, 1, 16, 5, block_m=16, block_n=16)


def case_fp8_keys_fp16_and_bf16_queries(T):
    """An fp8 KV cache (``--kv-cache-dtype fp8_e4m3``): the kernel converts each key tile to the
    probe's dtype as it loads it (exact), so the scores are those of the keys converted first."""
    for dtype, seed in ((torch.float16, 8), (torch.bfloat16, 9)):
        q, keys, pos = probe_inputs(50, 20, 4, 2, 32, dtype, seed)
        keys = keys.to(torch.float8_e4m3fn)
        want = reference.kvzip_probe_scores(q, keys.to(dtype), pos, 50)
        close(T.kvzip_probe_scores(q, keys, pos, 50, block_m=16, block_n=16), want, dtype, f"fp8 {dtype}")


def case_refusals(T):
    q, keys, pos = probe_inputs(10, 6, 4, 2, 16, torch.float32, 6)
    for bad, why in [(dict(q_positions=pos - 1), "positions"), (dict(context_len=0), "context_len"),
                     (dict(keys=keys.half()), "dtype"), (dict(q_probe=q[:, :3]), "multiple")]:
        args = dict(q_probe=q, keys=keys, q_positions=pos, context_len=10) | bad
        try:
            T.kvzip_probe_scores(**args)
        except ValueError as exc:
            assert why in str(exc), str(exc)
        else:
            raise AssertionError(f"no refusal for {why}")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    from sgl_kernel_sparse.triton_kvzip import kvzip_probe_scores

    return run_cases(CASES, SimpleNamespace(kvzip_probe_scores=kvzip_probe_scores))


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_dispatch_blocks_queries_on_the_cpu():
    """Off CUDA the dispatch runs the reference over blocks of probe queries: the same scores as
    one call over all of them (the blocks combine by max)."""
    q, keys, pos = probe_inputs(50, 45, 4, 2, 16, torch.float32, 7, gap=3)
    whole = reference.kvzip_probe_scores(q, keys, pos, 50)
    torch.testing.assert_close(dispatch.kvzip_probe_scores(q, keys, pos, 50, query_block=8), whole)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kvzip_probe_scores(dtype):
    """A 8B-shape layer (32 / 8 heads, d 128): 3,000 context keys, a 3,100-token probe."""
    q, keys, pos = probe_inputs(3000, 3100, 32, 8, 128, dtype, 11, gap=5)
    q, keys, pos = q.cuda(), keys.cuda(), pos.cuda()
    want = dispatch.kvzip_probe_scores(q.cpu(), keys.cpu(), pos.cpu(), 3000, query_block=256)
    got = dispatch.kvzip_probe_scores(q, keys, pos, 3000)  # the Triton kernel on CUDA
    close(got.cpu(), want, dtype, f"{dtype}")


@pytest.mark.gpu
def test_gpu_kvzip_probe_scores_fp8_keys():
    """bf16 probe queries over fp8 keys (``--kv-cache-dtype fp8_e4m3``), converted in the kernel."""
    q, keys, pos = probe_inputs(3000, 1000, 32, 8, 128, torch.bfloat16, 12)
    keys = keys.to(torch.float8_e4m3fn)
    want = dispatch.kvzip_probe_scores(q, keys.to(torch.bfloat16), pos, 3000, query_block=256)
    got = dispatch.kvzip_probe_scores(q.cuda(), keys.cuda(), pos.cuda(), 3000)
    close(got.cpu(), want, torch.bfloat16, "fp8 keys")


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
