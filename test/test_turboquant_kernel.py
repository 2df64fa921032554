"""TurboQuant's Triton decode kernel (``sgl_kernel_sparse.triton_turboquant``) against the
plain-torch reference (``turboquant.turboquant_decode_attention``).

CPU, default suite: the kernel under the Triton interpreter on small shapes, in *one* subprocess
(``python test_turboquant_kernel.py --interp``, see ``interpreter_cases``), each ``case_*``
reported to its own pytest test: bits 2 / 3 / 4 (3 bits: codes straddling bytes) and mixed key /
value bits, GQA and MHA, several block counts and G (16, 32, and 8 and 24: tiles spanning
blocks), residual lengths including 0, ragged batches with empty requests, split-K, fused-buffer
strides, int32 and int64 tables, fp32 / fp16 / bf16.
GPU (``-m gpu``, skipped without CUDA): the compiled kernel on realistic shapes vs the reference.
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

from sgl_kernel_sparse import turboquant as tq  # noqa: E402

from interpreter_cases import interpreter_test, report, run_cases  # noqa: E402
import quant_case  # noqa: E402
from quant_case import (assert_empty_requests_zero, block_table, residual_pool,  # noqa: E402
                        strided_query, to_cuda)


def tq_inputs(b, hq, hkv, d, bits, group, n_blocks, res_lens, dtype, seed, idx_dtype=torch.int32,
              fused=False):
    """A TurboQuant layer as the store holds it: shuffled blocks of codes + fp16 norms (a few
    spare blocks, a NaN-norm block that every block-table padding entry points to), a residual
    pool (a view into a fused K/V buffer; table entries past res_len point to NaN slots),
    non-contiguous q. ``bits`` an int or ``(k_bits, v_bits)``. ``fused``: codes and norms are
    views into fused K/V buffers too (non-trivial strides)."""
    kb, vb = (bits, bits) if isinstance(bits, int) else bits
    g = torch.Generator().manual_seed(seed)
    n_req = b + 2
    n_blk = sum(n_blocks) + 3
    rot = tq.rotation(d, seed)
    kcb, vcb = tq.codebook(kb, d), tq.codebook(vb, d)
    k = torch.randn(n_blk * group, hkv, d, generator=g) * (1 + 3 * torch.rand(1, 1, d, generator=g))
    v = torch.randn(n_blk * group, hkv, d, generator=g)
    kc, kn = tq.quantize_blocks(k, rot, kcb, kb, group)
    vc, vn = tq.quantize_blocks(v, rot, vcb, vb, group)
    poison = n_blk - 1
    kn[poison] = float("nan")
    vn[poison] = float("nan")
    if fused:
        def fuse(a, c):
            buf = torch.stack([a, c], dim=1)
            return buf[:, 0]
        kc, vc = fuse(kc, torch.zeros_like(kc)), fuse(vc, torch.zeros_like(vc))
        kn, vn = fuse(kn, torch.zeros_like(kn)), fuse(vn, torch.zeros_like(vn))
    table, req_rows = block_table(g, b, n_req, n_blocks, poison)
    k_cache, v_cache, r2t = residual_pool(g, n_req, req_rows, res_lens, hkv, d, dtype)
    q = strided_query(g, b, hq, d, dtype)
    return dict(
        q=q, k_codes=kc, k_norms=kn, v_codes=vc, v_norms=vn, rot=rot, k_centroids=kcb, v_centroids=vcb,
        block_table=table.to(idx_dtype), req_rows=req_rows, n_blocks=torch.tensor(n_blocks, dtype=torch.int32),
        k_cache=k_cache, v_cache=v_cache, req_to_token=r2t.to(idx_dtype),
        res_len=torch.tensor(res_lens, dtype=torch.int32), bits=bits)


# fp16: the kernel rounds the scaled (rotated) query, each dequantized key / value and the
# probabilities to fp16 for its tensor-core dots; the reference dequantizes and attends in fp32.
# At d = 128, 3 bits, an output of -0.016 was 2.3e-3 off (max 3.9e-3 over the case, the
# reference's own fp16 output 6.7e-4 from fp32; found on the H200 and under the interpreter)
TOL = {**quant_case.TOL, torch.float16: (5e-3, 1e-2)}


def close(got, want, dtype, what):
    """``quant_case.close`` at this kernel's tolerances (``TOL``)."""
    quant_case.close(got, want, dtype, what, TOL)


def test_inputs_are_the_store_layout():
    """The builder's blocks hold what ``quantize_blocks`` writes (the store's layout)."""
    x = tq_inputs(2, 4, 2, 16, 3, 8, [2, 1], [3, 0], torch.float32, 0)
    assert x["k_codes"].shape[1:] == (2, 8, 6) and x["k_codes"].dtype == torch.uint8
    assert x["k_norms"].shape[1:] == (2, 8) and x["k_norms"].dtype == torch.float16


# ============================================================ interpreter (subprocess)


def _case(T, dtype, hq, hkv, d, bits, group, n_blocks, res_lens, seed, splits, idx_dtype=torch.int32,
          fused=False, scale=None, block_n=16):
    x = tq_inputs(len(n_blocks), hq, hkv, d, bits, group, n_blocks, res_lens, dtype, seed, idx_dtype, fused)
    want = tq.turboquant_decode_attention(**x, scale=scale)
    for sp in splits:
        got = T.turboquant_decode_attention(**x, scale=scale, num_splits=sp, block_n=block_n)
        close(got, want, dtype, f"turboquant bits={bits} D={d} G={group} splits={sp}")
        assert_empty_requests_zero(got, n_blocks, res_lens)


def case_fp32_bits3_gqa2_ragged(T):
    # blocks + residual, residual only, blocks only, nothing; more splits than some requests fill
    _case(T, torch.float32, 4, 2, 32, 3, 16, [3, 0, 2, 0], [5, 7, 0, 0], 1, (1, 3))


def case_fp32_bits2_mha_g8_tiles_span_blocks(T):
    _case(T, torch.float32, 2, 2, 16, 2, 8, [5, 1], [0, 19], 2, (1, 2))


def case_fp32_bits4_gqa4_g24_int64_scale(T):
    _case(T, torch.float32, 8, 2, 32, 4, 24, [2, 1], [3, 0], 3, (1, 2), idx_dtype=torch.int64, scale=0.3)


def case_fp16_bits3_gqa4_d64(T):
    _case(T, torch.float16, 4, 1, 64, 3, 32, [2, 1], [9, 1], 4, (1, 2))


def case_bf16_bits4_gqa2(T):
    _case(T, torch.bfloat16, 4, 2, 32, 4, 16, [1, 3], [2, 17], 5, (1, 3))


def case_fp32_mixed_bits_k4_v2_fused_default_splits(T):
    _case(T, torch.float32, 4, 4, 16, (4, 2), 16, [2, 3], [1, 17], 6, (None,), fused=True, block_n=None)


def case_fp16_bits2_d48_gqa3(T):
    _case(T, torch.float16, 6, 2, 48, 2, 16, [2, 0], [0, 5], 7, (1, 2))


def case_nothing_and_empty_batch_and_bad_layout(T):
    x = tq_inputs(2, 4, 2, 16, 3, 16, [0, 0], [0, 0], torch.float32, 8)
    for sp in (1, 2):
        got = T.turboquant_decode_attention(**x, num_splits=sp)
        assert got.shape == (2, 4, 16) and (got == 0).all()
    empty = dict(x, q=x["q"][:0], req_rows=x["req_rows"][:0], n_blocks=x["n_blocks"][:0], res_len=x["res_len"][:0])
    assert T.turboquant_decode_attention(**empty).shape == (0, 4, 16)
    for bad in (dict(bits=2), dict(k_centroids=x["k_centroids"][:4]), dict(rot=x["rot"][:8]),
                dict(k_norms=x["k_norms"][..., :4])):
        try:
            T.turboquant_decode_attention(**dict(x, **bad))
        except ValueError:
            continue
        raise AssertionError(f"{sorted(bad)} must be refused")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    """Subprocess side: run every case under the interpreter, report each outcome."""
    from sgl_kernel_sparse.triton_turboquant import turboquant_decode_attention

    return run_cases(CASES, SimpleNamespace(turboquant_decode_attention=turboquant_decode_attention))


test_triton_interpreter = interpreter_test(__file__, CASES)


# ============================================================ GPU: compiled kernel, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 16, 64)])
def test_gpu_turboquant_decode(dtype, bits, hq, hkv, d):
    from sgl_kernel_sparse.triton_turboquant import turboquant_decode_attention

    x = to_cuda(tq_inputs(4, hq, hkv, d, bits, 32, [64, 64, 17, 0], [50, 0, 50, 50], dtype, 800 + bits + d))
    want = tq.turboquant_decode_attention(**x)
    for splits in (None, 1, 7):
        close(turboquant_decode_attention(**x, num_splits=splits), want, dtype, f"splits={splits}")
    for stages in (1, 2):  # the benchmark's pipelining sweep
        close(turboquant_decode_attention(**x, num_stages=stages), want, dtype, f"num_stages={stages}")


@pytest.mark.gpu
def test_gpu_turboquant_quantizer_matches_cpu():
    """The store quantizes on the device in plain torch: the same codes as on the CPU (norms to
    fp16 rounding), so a block written on the GPU decodes as the reference expects."""
    g = torch.Generator().manual_seed(900)
    x = torch.randn(4 * 32, 8, 128, generator=g) * 3
    rot = tq.rotation(128, 1)
    for bits in (2, 3, 4):
        c = tq.codebook(bits, 128)
        kc, kn = tq.quantize_blocks(x, rot, c, bits, 32)
        gc, gn = tq.quantize_blocks(x.cuda(), rot.cuda(), c.cuda(), bits, 32)
        agree = (kc == gc.cpu()).float().mean().item()
        assert agree > 0.999, f"bits={bits}: {agree:.5f} of code bytes agree"  # ties at a bound may flip
        torch.testing.assert_close(gn.cpu(), kn, rtol=1e-3, atol=0)


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
