"""Palu's Triton decode kernel (``sgl_kernel_sparse.triton_palu``) against the plain-torch
reference (``palu.palu_decode_attention``).

CPU, default suite: the kernel under the Triton interpreter on small shapes, in *one* subprocess
(``python test_palu_kernel.py --interp``, see ``interpreter_cases``), each ``case_*`` reported to
its own pytest test: head_dim 64 / 128 (and 32 for speed), ranks 8 .. g*d, G 16 / 32 / 64 (and 24:
tiles spanning blocks), one and several KV heads per latent group, neox and GPT-J RoPE,
rotary_dim == and < head_dim, fp32 / fp16 / bf16, bias or not, ragged batches (0 blocks, 0
residual, a request with nothing), shared and out-of-order block tables, split-K.
Also CPU: the kernel compiled for sm_90 without a GPU (``bench/compile_report.py``'s compile, in a
subprocess), no register spills.
GPU (``-m gpu``, skipped without CUDA): the compiled kernel at a Qwen3-8B-like layer (Hq 32,
Hkv 8, d 128, r 64, G 32, 32K tokens, batch 4) in bf16 vs the reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "sgl-kernel-sparse" / "python") not in sys.path:  # the package from the checkout
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "python"))

from sgl_kernel_sparse import palu  # noqa: E402

from interpreter_cases import compile_report_rows, interpreter_test, report, run_cases  # noqa: E402
import quant_case  # noqa: E402
from quant_case import (assert_empty_requests_zero, block_table, residual_pool,  # noqa: E402
                        strided_query, to_cuda)


def rope_table(max_pos, rd, base=10000.0):
    """``[max_pos, rd]``: cos of the rd/2 frequencies, then their sin (fp32)."""
    inv = base ** (-torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).float()


def palu_inputs(b, hq, hkv, d, n_groups, rank, group, n_blocks, res_lens, dtype, seed, rd=None, neox=True,
                bias=False, idx_dtype=torch.int32, share=True, fused=False):
    """A Palu layer as the store holds it: latent blocks in the pool dtype (shuffled, a few spare,
    a NaN block that every block-table padding entry points to; with ``share`` the second request's
    table starts with the first's blocks, as a shared prefix), fp32 factors scaled so that K / V
    have unit-scale entries, a RoPE table, a residual pool (a view into a fused K/V buffer; table
    entries past res_len point to NaN slots), non-contiguous q. ``fused``: the latents are views
    into one K/V buffer (non-trivial strides)."""
    g = torch.Generator().manual_seed(seed)
    hg = hkv // n_groups
    n_req = b + 2
    n_blk = sum(n_blocks) + 3
    lat_k = torch.randn(n_blk, n_groups, group, rank, generator=g).to(dtype)
    lat_v = torch.randn(n_blk, n_groups, group, rank, generator=g).to(dtype)
    if fused:
        both = torch.stack([lat_k, lat_v], dim=2)  # [n, n_groups, 2, G, r]
        lat_k, lat_v = both[:, :, 0], both[:, :, 1]
    poison = n_blk - 1
    lat_k[poison] = float("nan")
    lat_v[poison] = float("nan")
    bk = torch.randn(n_groups, rank, hg * d, generator=g) / rank**0.5
    bv = torch.randn(n_groups, rank, hg * d, generator=g) / rank**0.5
    bias_k = torch.randn(hkv * d, generator=g) * 0.5 if bias else None
    bias_v = torch.randn(hkv * d, generator=g) * 0.5 if bias else None
    table, req_rows = block_table(g, b, n_req, n_blocks, poison)
    cos_sin = rope_table(table.shape[1] * group + 8, d if rd is None else rd)  # every table position
    if share and b > 1 and n_blocks[0] and n_blocks[1]:  # a shared prefix of blocks
        k = min(n_blocks[0], n_blocks[1], 2)
        table[req_rows[1], :k] = table[req_rows[0], :k]
    k_cache, v_cache, r2t = residual_pool(g, n_req, req_rows, res_lens, hkv, d, dtype)
    q = strided_query(g, b, hq, d, dtype, scale=2)
    return dict(q=q, lat_k=lat_k, lat_v=lat_v, bk=bk, bv=bv, bias_k=bias_k, bias_v=bias_v, cos_sin=cos_sin,
                neox=neox, block_table=table.to(idx_dtype), req_rows=req_rows,
                n_blocks=torch.tensor(n_blocks, dtype=torch.int32), k_cache=k_cache, v_cache=v_cache,
                req_to_token=r2t.to(idx_dtype), res_len=torch.tensor(res_lens, dtype=torch.int32))


# fp16 / bf16: the kernel rounds the scaled query, each rebuilt (rotated) key, the factors and
# the probabilities to the input dtype for its dots (bf16 in fp32 under the interpreter); the
# reference rebuilds and attends in fp32
TOL = {**quant_case.TOL, torch.float16: (5e-3, 1e-2)}


def close(got, want, dtype, what):
    """``quant_case.close`` at this kernel's tolerances (``TOL``)."""
    quant_case.close(got, want, dtype, what, TOL)


def test_inputs_are_the_store_layout():
    x = palu_inputs(2, 4, 2, 16, 1, 8, 16, [2, 1], [3, 0], torch.float32, 0)
    assert x["lat_k"].shape[1:] == (1, 16, 8) and x["bk"].shape == (1, 8, 32)
    assert x["cos_sin"].shape[1] == 16


# ============================================================ interpreter (subprocess)


def _case(T, dtype, hq, hkv, d, ng, rank, group, n_blocks, res_lens, seed, splits, block_n=16, **kw):
    x = palu_inputs(len(n_blocks), hq, hkv, d, ng, rank, group, n_blocks, res_lens, dtype, seed, **kw)
    want = palu.palu_decode_attention(**x)
    for sp in splits:
        got = T.palu_decode_attention(**x, num_splits=sp, block_n=block_n)
        close(got, want, dtype, f"palu D={d} r={rank} G={group} splits={sp} {kw}")
        assert_empty_requests_zero(got, n_blocks, res_lens)


def case_fp32_d64_r32_g16_neox_ragged(T):
    # blocks + residual, residual only, blocks only, nothing; more splits than some requests fill
    _case(T, torch.float32, 4, 2, 64, 2, 32, 16, [3, 0, 2, 0], [5, 7, 0, 0], 1, (1, 3))


def case_fp32_d64_r8_g32_gptj_bias(T):
    _case(T, torch.float32, 4, 2, 64, 2, 8, 32, [2, 1], [3, 17], 2, (1, 2), neox=False, bias=True)


def case_fp32_d128_r96_g16_neox_gqa4(T):
    _case(T, torch.float32, 8, 2, 128, 2, 96, 16, [2, 1, 0], [0, 4, 3], 3, (2,), idx_dtype=torch.int64)


def case_fp32_d64_grouped_g2_full_rank_bias_gptj(T):
    # two KV heads per latent group, r = g*d = 128
    _case(T, torch.float32, 4, 4, 64, 2, 128, 16, [2, 2], [1, 0], 4, (1, 2), neox=False, bias=True)


def case_fp32_d64_partial_rotary_neox_g64(T):
    _case(T, torch.float32, 2, 2, 64, 1, 64, 64, [1, 2], [2, 0], 5, (1, 2), rd=32, bias=True)


def case_fp32_d32_partial_rotary_gptj_g24_tiles_span(T):
    _case(T, torch.float32, 4, 2, 32, 1, 16, 24, [3, 1], [0, 9], 6, (1, 2), rd=16, neox=False)


def case_fp32_d128_r128_g1_full_rank_neox_bias_fused(T):
    _case(T, torch.float32, 2, 1, 128, 1, 128, 16, [2, 1], [3, 1], 11, (1, 2), bias=True, fused=True)


def case_fp32_d128_r8_gptj_partial_rotary(T):
    _case(T, torch.float32, 4, 2, 128, 2, 8, 16, [1, 2], [0, 6], 12, (1,), rd=64, neox=False)


def case_bf16_d128_grouped_g4_r64_g64_neox(T):
    _case(T, torch.bfloat16, 8, 4, 128, 1, 64, 64, [1, 0, 1], [3, 2, 0], 13, (1, 2), bias=True)


def case_fp16_d128_r64_g32_neox(T):
    _case(T, torch.float16, 4, 2, 128, 2, 64, 32, [2, 1], [5, 0], 7, (1, 2))


def case_bf16_d64_r16_g16_gptj_bias(T):
    _case(T, torch.bfloat16, 4, 2, 64, 1, 16, 16, [1, 3], [2, 17], 8, (1, 3), neox=False, bias=True)


def case_fp16_d64_default_splits_block_n(T):
    _case(T, torch.float16, 2, 2, 64, 2, 32, 16, [2, 0], [0, 5], 9, (None,), block_n=None)


def case_dispatch_palu_decode_calls_the_kernel(T):
    """``kernels.quantized.palu_decode`` hands the store's layer to the Triton kernel when
    ``use_triton`` says so (forced here: CPU tensors under the interpreter)."""
    import sgl_kernel_sparse
    import sgl_kernel_sparse.triton_palu as tp
    from sglang_sparse.kernels import quantized

    x = palu_inputs(3, 4, 2, 64, 1, 32, 16, [2, 0, 1], [3, 2, 0], torch.float32, 14, bias=True, neox=False)
    store = SimpleNamespace(factors=SimpleNamespace(bk=[None, x["bk"]], bv=[None, x["bv"]], bias_k=[None, x["bias_k"]],
                                                    bias_v=[None, x["bias_v"]]),
                            rope=SimpleNamespace(cos_sin=x["cos_sin"], neox=False),
                            layer=lambda i: (x["lat_k"], x["lat_v"]) if i == 1 else None)
    calls = []
    kernel, pick = tp.palu_decode_attention, sgl_kernel_sparse.use_triton
    tp.palu_decode_attention = lambda *a: calls.append(1) or kernel(*a, num_splits=2, block_n=16)
    sgl_kernel_sparse.use_triton = lambda *a: True
    try:
        got = quantized.palu_decode(x["q"], store, 1, x["block_table"], x["req_rows"], x["n_blocks"], x["k_cache"],
                                    x["v_cache"], x["req_to_token"], x["res_len"], 0.2)
    finally:
        tp.palu_decode_attention, sgl_kernel_sparse.use_triton = kernel, pick
    assert calls == [1], "the Triton kernel was not called"
    close(got, palu.palu_decode_attention(**x, scale=0.2), torch.float32, "dispatch")


def case_nothing_and_empty_batch_and_bad_layout(T):
    x = palu_inputs(2, 4, 2, 16, 1, 8, 16, [0, 0], [0, 0], torch.float32, 10)
    for sp in (1, 2):
        got = T.palu_decode_attention(**x, num_splits=sp)
        assert got.shape == (2, 4, 16) and (got == 0).all()
    empty = dict(x, q=x["q"][:0], req_rows=x["req_rows"][:0], n_blocks=x["n_blocks"][:0], res_len=x["res_len"][:0])
    assert T.palu_decode_attention(**empty).shape == (0, 4, 16)
    for bad in (dict(bk=x["bk"][..., :16]), dict(lat_v=x["lat_v"][..., :4]), dict(cos_sin=x["cos_sin"][:, :3]),
                dict(bias_k=torch.zeros(5))):
        try:
            T.palu_decode_attention(**dict(x, **bad))
        except ValueError:
            continue
        raise AssertionError(f"{sorted(bad)} must be refused")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    """Subprocess side: run every case under the interpreter, report each outcome (every case
    skipped when this Triton cannot be imported)."""
    try:
        from sgl_kernel_sparse.triton_palu import palu_decode_attention
    except ImportError as exc:
        return {name: ["skip", f"triton_palu not importable: {exc}"] for name in CASES}

    return run_cases(CASES, SimpleNamespace(palu_decode_attention=palu_decode_attention))


test_triton_interpreter = interpreter_test(__file__, CASES)


# ============================================================ sm_90 compile (no GPU needed)

COMPILED = [  # (n_groups, rank, rotary_dim, neox, bias, dtype, splits) at Hq 32, Hkv 8, d 128, G 32
    (8, 64, 128, True, False, torch.bfloat16, 1), (8, 64, 128, False, True, torch.bfloat16, 4),
    (4, 128, 128, True, False, torch.bfloat16, 4), (8, 32, 64, True, True, torch.float16, 1),
]


def _compile_report(out: str) -> None:
    """Subprocess side (``--compile-report OUT``): ``bench/compile_report.py``'s ahead-of-time
    compile for sm_90 of the variants above, its report as JSON (exit 3: unsupported Triton)."""
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "bench"))
    import compile_report as C

    def exercise(_dtypes):
        from sgl_kernel_sparse.triton_palu import palu_decode_attention

        b, hq, hkv, d, group = 4, 32, 8, 128, 32
        idx = torch.zeros(b, 64, dtype=torch.int32)
        req = torch.arange(b, dtype=torch.int32)
        for ng, rank, rd, neox, bias, dt, splits in COMPILED:
            lat = torch.zeros(256, ng, group, rank, dtype=dt)
            fac = torch.zeros(ng, rank, hkv // ng * d)
            bi = torch.zeros(hkv * d) if bias else None
            kv = torch.zeros(4096, hkv, d, dtype=dt)
            palu_decode_attention(torch.zeros(b, hq, d, dtype=dt), lat, lat, fac, fac, bi, bi, torch.zeros(4096, rd),
                                  neox, idx, req, req, kv, kv, idx, req, num_splits=splits, dot16=True)

    C.EXERCISE["palu"] = exercise
    Path(out).write_text(json.dumps(C.compile_all(90, ["bf16"], ["palu"])))


def test_palu_kernel_compiles_for_sm90_without_spills(tmp_path):
    """16-bit dot operands (as on the GPU), 8 warps: no register spills up to r = 128."""
    rows = [r for r in compile_report_rows(__file__, tmp_path / "report.json") if r["kernel"] == "_palu_decode_kernel"]
    assert len(rows) == len(COMPILED)
    assert all(r["spill_bytes"] <= 64 for r in rows), [(r["constexprs"], r["spill_bytes"]) for r in rows]


# ============================================================ GPU: compiled kernel, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("neox", [True, False])
def test_gpu_palu_decode_qwen3_8b_shape(neox):
    """Hq 32, Hkv 8, d 128, r 64 (ratio 0.5, per head), G 32, 32K tokens, batch 4, bf16: whole
    blocks and residual rows of different lengths, one request residual-only."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from sgl_kernel_sparse.triton_palu import palu_decode_attention

    nb = (32768 - 64) // 32
    x = to_cuda(palu_inputs(4, 32, 8, 128, 8, 64, 32, [nb, nb - 37, 5, 0], [64, 0, 40, 50], torch.bfloat16, 900,
                            neox=neox, bias=not neox))
    want = palu.palu_decode_attention(**x)
    for splits in (None, 1, 7):
        close(palu_decode_attention(**x, num_splits=splits), want, torch.bfloat16, f"splits={splits}")
    graph = torch.cuda.CUDAGraph()  # no host sync inside: capturable, replays the same output
    palu_decode_attention(**x)
    with torch.cuda.graph(graph):
        out = palu_decode_attention(**x)
    graph.replay()
    torch.cuda.synchronize()
    close(out, want, torch.bfloat16, "cuda graph replay")


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
elif __name__ == "__main__" and "--compile-report" in sys.argv:
    _compile_report(sys.argv[sys.argv.index("--compile-report") + 1])
