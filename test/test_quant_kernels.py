"""Quantized KV payloads (sgl_kernel_sparse.quant, triton_kivi, triton_fp8): KIVI 2/4-bit and FP8
(TurboQuant's kernel: test_turboquant_kernel.py, Palu's: test_palu_kernel.py; both compile here with
the others).

CPU, default suite:
- the references against loop-based readings of the formulas (KIVI codes, scales and minima
  exactly, in fp32 arithmetic one operation at a time; packing; the s/2 error bound; e4m3 round
  trips and the clamp at 448 * scale; both attention references against plain softmax attention
  over explicitly dequantized K/V);
- both Triton kernels under the Triton interpreter on small shapes, in *one* subprocess
  (``python test_quant_kernels.py --interp``, ``TRITON_INTERPRET`` set before triton is
  imported), each ``case_*`` reported back to its own pytest test;
- both kernels, and TurboQuant's and Palu's, compiled for sm_90 without a GPU (``bench/compile_report.py
  --groups quant``).
GPU (``-m gpu``, skipped without CUDA): compiled kernels on realistic shapes vs the references.
"""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PKG_ROOT = ROOT / "sgl-kernel-sparse"
if str(PKG_ROOT / "python") not in sys.path:  # the package is used from the checkout
    sys.path.insert(0, str(PKG_ROOT / "python"))

from sgl_kernel_sparse import quant as Q  # noqa: E402


from interpreter_cases import interpreter_test, report, run_cases  # noqa: E402
from quant_case import (assert_empty_requests_zero, block_table, close,  # noqa: E402
                        poison_slots_past, residual_pool, strided_query, to_cuda)


# ============================================================ shared input builders


def kivi_inputs(b, hq, hkv, d, bits, group, n_blocks, res_lens, dtype, seed,
                idx_dtype=torch.int32, fused=False):
    """A KIVI layer: quantized blocks (shuffled, a few spare ones, a NaN-poisoned block that
    every block-table padding entry points to), a residual pool (a view into a fused K/V buffer;
    table entries past res_len point to NaN-poisoned slots), non-contiguous q. ``fused``: the
    code / scale tensors are views into fused K/V buffers too (non-trivial strides)."""
    g = torch.Generator().manual_seed(seed)
    n_req = b + 2
    n_blk = sum(n_blocks) + 3
    k = torch.randn(n_blk * group, hkv, d, generator=g) * (1 + 3 * torch.rand(1, 1, d, generator=g))
    v = torch.randn(n_blk * group, hkv, d, generator=g)
    kc, ks, km = Q.kivi_quantize_keys(k, bits, group)
    vc, vs, vm = Q.kivi_quantize_values(v, bits, group)
    poison = n_blk - 1
    ks[poison] = float("nan")
    vs[poison] = float("nan")
    if fused:
        def fuse(a, c):
            buf = torch.stack([a, c], dim=1)
            return buf[:, 0], buf[:, 1]
        kc, vc = fuse(kc, vc)
        ks, vs = fuse(ks, torch.zeros_like(ks))[0], fuse(vs, torch.zeros_like(vs))[0]
    table, req_rows = block_table(g, b, n_req, n_blocks, poison)
    k_cache, v_cache, r2t = residual_pool(g, n_req, req_rows, res_lens, hkv, d, dtype)
    q = strided_query(g, b, hq, d, dtype)
    return dict(
        q=q, k_codes=kc, k_scale=ks, k_min=km, v_codes=vc, v_scale=vs, v_min=vm,
        block_table=table.to(idx_dtype), req_rows=req_rows,
        n_blocks=torch.tensor(n_blocks, dtype=torch.int32), k_cache=k_cache, v_cache=v_cache,
        req_to_token=r2t.to(idx_dtype), res_len=torch.tensor(res_lens, dtype=torch.int32),
        bits=bits, group=group)


def fp8_inputs(b, hq, hkv, d, seq_lens, dtype, seed, per_head=True, idx_dtype=torch.int64):
    """An fp8 pool (per-head or per-tensor scales, one head 10x larger than the others), shuffled
    slots, table entries past seq_len pointing to slots holding NaN."""
    g = torch.Generator().manual_seed(seed)
    n_req = b + 1
    ctx = max(seq_lens) + 3
    num_slots = n_req * ctx + 4
    k = torch.randn(num_slots, hkv, d, generator=g)
    v = torch.randn(num_slots, hkv, d, generator=g)
    k[:, 0] *= 10
    k_scale, v_scale = Q.fp8_scales(k, per_head), Q.fp8_scales(v, per_head)
    k8, v8 = Q.fp8_quantize(k, k_scale), Q.fp8_quantize(v, v_scale)
    r2t = torch.randperm(num_slots, generator=g)[: n_req * ctx].view(n_req, ctx)
    req_rows = torch.randperm(n_req, generator=g)[:b]
    poison_slots_past(r2t, req_rows, seq_lens, k8, v8)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    return dict(q=q, k8=k8, v8=v8, k_scale=k_scale, v_scale=v_scale,
                req_to_token=r2t.to(idx_dtype), req_rows=req_rows,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32))


# ============================================================ references by definition


def f32(x: float) -> float:
    """Round a python float to fp32. One +, -, * or / of two fp32 values done in double and then
    rounded is the correctly rounded fp32 result, so chaining ``f32`` replays fp32 arithmetic."""
    return struct.unpack("f", struct.pack("f", x))[0]


def loop_kivi_group(xs, bits):
    """KIVI on one group, by the formula, in fp32 one operation at a time: (codes, s, mn)."""
    levels = 2**bits - 1
    mn, mx = min(xs), max(xs)
    s = f32(f32(mx - mn) / levels)
    if s == 0:
        return [0] * len(xs), s, mn
    codes = [min(max(math.floor(f32(f32(f32(x - mn) / s) + 0.5)), 0), levels) for x in xs]
    return codes, s, mn


def _boundary_data(bits, group, hkv, d, n, seed):
    """Random keys/values with two planted groups per tensor: a constant one (s == 0) and one
    whose values sit exactly on .5 boundaries (mn = 0, s = 1: x = k + 0.5 -> code k + 1)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n * group, hkv, d, generator=g)
    levels = 2**bits - 1
    ramp = torch.tensor([0.0, float(levels)] + [k + 0.5 for k in range(group - 2)]).clamp(max=levels)
    return x, ramp


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_by_definition(bits):
    group, hkv, d, n = 4, 2, 8, 3
    k, ramp = _boundary_data(bits, group, hkv, d, n, 1 + bits)
    k[0:group, 0, 3] = 1.25  # block 0, head 0, channel 3: constant -> s == 0
    k[group : 2 * group, 1, 5] = ramp  # block 1, head 1, channel 5: .5 boundaries
    codes, s, mn = Q.kivi_quantize_keys(k, bits, group)
    assert codes.shape == (n, hkv, group, d * bits // 8) and codes.dtype == torch.uint8
    assert s.shape == mn.shape == (n, hkv, d) and s.dtype == mn.dtype == torch.float32
    unpacked = Q.unpack_codes(codes, bits)  # [n, Hkv, G, D]
    deq = Q.kivi_dequantize_keys(codes, s, mn, bits)
    assert deq.shape == k.shape and deq.dtype == torch.float32
    for blk in range(n):
        for h in range(hkv):
            for c in range(d):
                xs = k[blk * group : (blk + 1) * group, h, c].tolist()
                want_codes, want_s, want_mn = loop_kivi_group(xs, bits)
                assert unpacked[blk, h, :, c].tolist() == want_codes, (blk, h, c)
                assert s[blk, h, c].item() == want_s and mn[blk, h, c].item() == want_mn
                for t in range(group):
                    x_hat = f32(f32(want_codes[t] * want_s) + want_mn)
                    assert deq[blk * group + t, h, c].item() == x_hat
    assert unpacked[0, 0, :, 3].tolist() == [0] * group and s[0, 0, 3] == 0
    assert (deq[0:group, 0, 3] == 1.25).all(), "a constant group dequantizes exactly"
    want = [0, 2**bits - 1] + [min(k + 1, 2**bits - 1) for k in range(group - 2)]
    assert unpacked[1, 1, :, 5].tolist() == want, "x = k + .5 rounds up"


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_values_by_definition(bits):
    group, hkv, d, n = 4, 2, 8, 2
    v, ramp = _boundary_data(bits, group, hkv, d, n, 11 + bits)
    v[2, 1, 4:8] = -0.75  # token 2, head 1, channel group 1: constant
    v[5, 0, 0:4] = ramp  # token 5, head 0, channel group 0: .5 boundaries
    codes, s, mn = Q.kivi_quantize_values(v, bits, group)
    assert codes.shape == (n, hkv, group, d * bits // 8) and codes.dtype == torch.uint8
    assert s.shape == mn.shape == (n, hkv, group, d // group)
    unpacked = Q.unpack_codes(codes, bits)
    deq = Q.kivi_dequantize_values(codes, s, mn, bits)
    assert deq.shape == v.shape
    for tok in range(n * group):
        blk, t = divmod(tok, group)
        for h in range(hkv):
            for cg in range(d // group):
                chans = range(cg * group, (cg + 1) * group)
                want_codes, want_s, want_mn = loop_kivi_group(v[tok, h, cg * group : (cg + 1) * group].tolist(), bits)
                assert unpacked[blk, h, t, cg * group : (cg + 1) * group].tolist() == want_codes
                assert s[blk, h, t, cg].item() == want_s and mn[blk, h, t, cg].item() == want_mn
                for i, c in enumerate(chans):
                    assert deq[tok, h, c].item() == f32(f32(want_codes[i] * want_s) + want_mn)
    assert s[0, 1, 2, 1] == 0 and (deq[2, 1, 4:8] == -0.75).all()
    want = [0, 2**bits - 1] + [min(k + 1, 2**bits - 1) for k in range(group - 2)]
    assert unpacked[1, 0, 1, 0:4].tolist() == want


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_error_bound(bits):
    """Per element ``|x - x_hat| <= s/2`` (up to fp32 rounding), keys and values, G = 32."""
    g = torch.Generator().manual_seed(20 + bits)
    x = torch.randn(4 * 32, 3, 64, generator=g) * 5
    codes, s, mn = Q.kivi_quantize_keys(x, bits, 32)
    err = (Q.kivi_dequantize_keys(codes, s, mn, bits) - x).abs().view(4, 32, 3, 64)
    assert (err <= s.unsqueeze(1) / 2 + 1e-5).all()
    codes, s, mn = Q.kivi_quantize_values(x, bits, 32)
    err = (Q.kivi_dequantize_values(codes, s, mn, bits) - x).abs()  # [T, Hkv, D]
    bound = s.permute(0, 2, 1, 3).reshape(4 * 32, 3, 2).repeat_interleave(32, dim=-1) / 2
    assert (err <= bound + 1e-5).all()


def test_pack_codes_layout_and_round_trip():
    assert Q.pack_codes(torch.tensor([1, 2, 3, 0, 3, 3, 3, 3], dtype=torch.uint8), 2).tolist() == [
        1 | 2 << 2 | 3 << 4, 255]  # channels 4j..4j+3 in bits 0-1, 2-3, 4-5, 6-7
    assert Q.pack_codes(torch.tensor([5, 12], dtype=torch.uint8), 4).tolist() == [5 | 12 << 4]
    g = torch.Generator().manual_seed(3)
    for bits in (2, 4):
        codes = torch.randint(0, 2**bits, (3, 5, 16), generator=g).to(torch.uint8)
        packed = Q.pack_codes(codes, bits)
        assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
        assert torch.equal(Q.unpack_codes(packed, bits), codes)
    with pytest.raises(ValueError):
        Q.pack_codes(torch.zeros(3, dtype=torch.uint8), 2)
    with pytest.raises(ValueError):
        Q.kivi_quantize_keys(torch.zeros(8, 1, 8), 3, 4)
    with pytest.raises(ValueError):
        Q.kivi_quantize_values(torch.zeros(8, 1, 12), 2, 8)  # group does not divide D


def test_fp8_round_trip_and_clamp():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 3, 16, generator=g) * torch.tensor([1.0, 100.0, 0.01]).view(1, 3, 1)
    x[:, 2] = 0.0  # an all-zero head: scale 1.0
    s_head = Q.fp8_scales(x, per_head=True)
    s_all = Q.fp8_scales(x, per_head=False)
    assert s_head.shape == (3,) and s_all.shape == (1,) and s_head.dtype == torch.float32
    for h in range(2):
        assert s_head[h].item() == f32(x[:, h].abs().max().item() / 448.0)
    assert s_head[2].item() == 1.0 and s_all.item() == f32(x.abs().max().item() / 448.0)
    assert Q.fp8_scales(torch.zeros(4, 2, 8), per_head=False).tolist() == [1.0]
    for sc in (s_head, s_all):
        x8 = Q.fp8_quantize(x, sc)
        assert x8.dtype == torch.float8_e4m3fn
        back = Q.fp8_dequantize(x8, sc)
        assert back.dtype == torch.float32
        y = x / sc.view(-1, 1)  # the amax maps to 448 exactly, nothing clamps
        assert (y.abs() <= 448 * (1 + 1e-6)).all()
        normal = y.abs() >= 2.0**-6  # e4m3's smallest normal
        rel = ((back - x).abs() / x.abs())[normal]
        assert rel.max() <= 2.0**-4 + 1e-6, "round to nearest: half an ulp of 3 mantissa bits"
        assert (back[~normal] - x[~normal]).abs().max() <= 2.0**-10 * sc.max()
    # the clamp at +-448 * scale (a cast of > 448 to e4m3fn alone would give NaN)
    sc = torch.tensor([0.5, 2.0])
    big = torch.tensor([[[1000.0, -1000.0, 224.0, 10.0]], [[5000.0, -897.0, 896.0, 2.0]]]).view(2, 1, 4)
    big = big.permute(1, 0, 2)  # [T=1, Hkv=2, 4]
    back = Q.fp8_dequantize(Q.fp8_quantize(big, sc), sc)
    assert back.tolist() == [[[224.0, -224.0, 224.0, 10.0], [896.0, -896.0, 896.0, 2.0]]]


def _softmax_attention(q, k, v, scale):
    """One query ``[D]`` over keys / values ``[N, D]``, by the definition."""
    w = torch.softmax((k.float() @ q.float()) * scale, dim=0)
    return w @ v.float()


def test_kivi_attention_reference_by_definition():
    x = kivi_inputs(4, 4, 2, 16, 4, 8, [3, 0, 2, 0], [5, 6, 0, 0], torch.float32, 7)
    out = Q.kivi_decode_attention(**x, scale=0.4)
    assert out.shape == (4, 4, 16) and out.dtype == torch.float32
    for b in range(4):
        row = int(x["req_rows"][b])
        nb, nr = int(x["n_blocks"][b]), int(x["res_len"][b])
        blocks = x["block_table"][row, :nb].long()
        keys = Q.kivi_dequantize_keys(x["k_codes"][blocks], x["k_scale"][blocks], x["k_min"][blocks], 4)
        vals = Q.kivi_dequantize_values(x["v_codes"][blocks], x["v_scale"][blocks], x["v_min"][blocks], 4)
        slots = x["req_to_token"][row, :nr].long()
        keys = torch.cat([keys, x["k_cache"][slots]])
        vals = torch.cat([vals, x["v_cache"][slots]])
        assert keys.shape[0] == nb * 8 + nr
        for h in range(4):
            if keys.shape[0] == 0:
                assert (out[b, h] == 0).all(), "nothing to attend to -> zeros"
                continue
            want = _softmax_attention(x["q"][b, h], keys[:, h // 2], vals[:, h // 2], 0.4)
            torch.testing.assert_close(out[b, h], want, atol=1e-6, rtol=1e-5)
    # default scale 1/sqrt(D); half-precision q -> output in q's dtype
    default = Q.kivi_decode_attention(**x)
    torch.testing.assert_close(default, Q.kivi_decode_attention(**x, scale=16**-0.5))
    x16 = dict(x, q=x["q"].half())
    assert Q.kivi_decode_attention(**x16).dtype == torch.float16


def test_fp8_attention_reference_by_definition():
    x = fp8_inputs(3, 4, 2, 16, [9, 0, 4], torch.float32, 8)
    out = Q.fp8_decode_attention(**x, scale=0.3)
    for b in range(3):
        slots = x["req_to_token"][int(x["req_rows"][b]), : int(x["seq_lens"][b])].long()
        k = x["k8"][slots].float() * x["k_scale"].view(1, -1, 1)
        v = x["v8"][slots].float() * x["v_scale"].view(1, -1, 1)
        for h in range(4):
            if slots.numel() == 0:
                assert (out[b, h] == 0).all()
                continue
            want = _softmax_attention(x["q"][b, h], k[:, h // 2], v[:, h // 2], 0.3)
            torch.testing.assert_close(out[b, h], want, atol=1e-6, rtol=1e-5)


def test_kivi_layout_checks():
    x = kivi_inputs(1, 2, 1, 16, 2, 8, [1], [1], torch.float32, 9)
    with pytest.raises(ValueError, match="blocks of 8"):
        Q.kivi_decode_attention(**dict(x, group=4))
    with pytest.raises(ValueError, match="v_scale"):
        Q.kivi_decode_attention(**dict(x, v_scale=x["v_scale"][..., :1]))
    with pytest.raises(ValueError, match="bits"):
        Q.kivi_decode_attention(**dict(x, bits=8))


# ============================================================ Triton, interpreter (subprocess)


def _kivi_case(T, dtype, hq, hkv, d, bits, group, n_blocks, res_lens, seed, splits,
               idx_dtype=torch.int32, fused=False, scale=None, block_n=8):
    x = kivi_inputs(len(n_blocks), hq, hkv, d, bits, group, n_blocks, res_lens, dtype, seed,
                    idx_dtype, fused)
    want = Q.kivi_decode_attention(**x, scale=scale)
    for sp in splits:
        got = T.kivi_decode_attention(**x, scale=scale, num_splits=sp, block_n=block_n)
        close(got, want, dtype, f"kivi bits={bits} D={d} G={group} splits={sp}")
        assert_empty_requests_zero(got, n_blocks, res_lens)


def case_kivi_fp32_bits2_gqa2_ragged(T):
    # blocks + residual, residual only, blocks only, nothing; splits > blocks of some requests
    _kivi_case(T, torch.float32, 4, 2, 64, 2, 32, [3, 0, 2, 0], [5, 7, 0, 0], 1, (1, 3))


def case_kivi_fp16_bits4_gqa4_int64(T):
    _kivi_case(T, torch.float16, 8, 2, 128, 4, 32, [2, 1], [3, 0], 2, (1, 2),
               idx_dtype=torch.int64)


def case_kivi_bf16_bits2_mha_group16(T):
    _kivi_case(T, torch.bfloat16, 2, 2, 64, 2, 16, [1, 4], [9, 2], 3, (1, 4))


def case_kivi_fp32_bits4_d48_group16(T):
    _kivi_case(T, torch.float32, 2, 1, 48, 4, 16, [2, 1], [0, 20], 4, (1, 2), scale=0.3)


def case_kivi_fused_strides_default_splits(T):
    _kivi_case(T, torch.float32, 4, 4, 32, 4, 16, [2, 3], [1, 17], 5, (None,), fused=True,
               block_n=None)


def case_kivi_nothing_and_empty_batch(T):
    x = kivi_inputs(2, 4, 2, 32, 2, 16, [0, 0], [0, 0], torch.float32, 6)
    for sp in (1, 2):
        got = T.kivi_decode_attention(**x, num_splits=sp)
        assert got.shape == (2, 4, 32) and (got == 0).all()
    empty = dict(x, q=x["q"][:0], req_rows=x["req_rows"][:0], n_blocks=x["n_blocks"][:0],
                 res_len=x["res_len"][:0])
    assert T.kivi_decode_attention(**empty).shape == (0, 4, 32)
    try:
        T.kivi_decode_attention(**dict(x, group=16, bits=3))
    except ValueError:
        pass
    else:
        raise AssertionError("bits=3 must be refused")


def _fp8_case(T, dtype, hq, hkv, d, seq_lens, seed, per_head, splits, idx_dtype=torch.int64,
              scale=None):
    x = fp8_inputs(len(seq_lens), hq, hkv, d, seq_lens, dtype, seed, per_head, idx_dtype)
    want = Q.fp8_decode_attention(**x, scale=scale)
    for sp in splits:
        got = T.fp8_decode_attention(**x, scale=scale, num_splits=sp, block_n=8)
        close(got, want, dtype, f"fp8 D={d} per_head={per_head} splits={sp}")
        for b, n in enumerate(seq_lens):
            if n == 0:
                assert (got[b] == 0).all()


def case_fp8_fp32_per_head_gqa2(T):
    _fp8_case(T, torch.float32, 4, 2, 64, [37, 0, 8, 1], 10, True, (1, 2, 5))


def case_fp8_fp16_per_tensor_gqa4_int32(T):
    _fp8_case(T, torch.float16, 8, 2, 128, [20, 9], 11, False, (1, 3), idx_dtype=torch.int32)


def case_fp8_bf16_d48_mha(T):
    _fp8_case(T, torch.bfloat16, 2, 2, 48, [30, 5], 12, True, (1, 2), scale=0.2)


def case_fp8_all_empty_and_bad_scales(T):
    x = fp8_inputs(2, 2, 1, 16, [0, 0], torch.float32, 13)
    assert (T.fp8_decode_attention(**x, num_splits=2) == 0).all()
    for bad in (torch.ones(3), torch.ones(1, dtype=torch.float16)):
        try:
            T.fp8_decode_attention(**dict(x, k_scale=bad))
        except ValueError:
            continue
        raise AssertionError(f"k_scale {bad} must be refused")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    """Subprocess side: run every case under the interpreter, report each outcome."""
    from sgl_kernel_sparse.triton_fp8 import fp8_decode_attention
    from sgl_kernel_sparse.triton_kivi import kivi_decode_attention

    return run_cases(CASES, SimpleNamespace(kivi_decode_attention=kivi_decode_attention,
                                            fp8_decode_attention=fp8_decode_attention))


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_quant_kernels_compile_for_sm90_without_spills(tmp_path):
    """fp16 + fp32; the full matrix: ``python sgl-kernel-sparse/bench/compile_report.py
    --groups quant`` (or ``core,quant``)."""
    report = tmp_path / "report.json"
    res = subprocess.run(
        [sys.executable, str(PKG_ROOT / "bench" / "compile_report.py"), "--groups", "quant",
         "--dtypes", "fp16,fp32", "--json", str(report)], capture_output=True, text=True,
        timeout=300)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    rows = json.loads(report.read_text())
    assert {r["kernel"] for r in rows} == {"_kivi_decode_kernel", "_fp8_decode_kernel", "_turboquant_decode_kernel",
                                           "_palu_decode_kernel", "_decode_reduce_kernel"}
    kivi = {(r["constexprs"]["BITS"], r["constexprs"]["SPLIT"]) for r in rows
            if r["kernel"] == "_kivi_decode_kernel"}
    assert kivi == {(2, False), (2, True), (4, False), (4, True)}
    tq = {(r["constexprs"]["KBITS"], r["constexprs"]["SPLIT"]) for r in rows
          if r["kernel"] == "_turboquant_decode_kernel"}
    assert tq == {(b, s) for b in (2, 3, 4) for s in (False, True)}


# ============================================================ GPU: compiled kernels, real shapes

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 16, 64)])
def test_gpu_kivi_decode(dtype, bits, hq, hkv, d):
    from sgl_kernel_sparse.triton_kivi import kivi_decode_attention

    x = to_cuda(kivi_inputs(4, hq, hkv, d, bits, 32, [64, 64, 17, 0], [50, 0, 50, 50], dtype,
                            500 + bits + d))
    want = Q.kivi_decode_attention(**x)
    for splits in (None, 1, 7):
        close(kivi_decode_attention(**x, num_splits=splits), want, dtype, f"splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [True, False])
def test_gpu_fp8_decode(dtype, per_head):
    from sgl_kernel_sparse.triton_fp8 import fp8_decode_attention

    x = to_cuda(fp8_inputs(4, 32, 8, 128, [4096 + 17, 2048, 1, 0], dtype, 600, per_head))
    want = Q.fp8_decode_attention(**x)
    for splits in (None, 1, 9):
        close(fp8_decode_attention(**x, num_splits=splits), want, dtype, f"splits={splits}")


@pytest.mark.gpu
def test_gpu_quantizers_match_cpu():
    """The quantizers are plain torch: the same codes and scales on CUDA as on CPU."""
    g = torch.Generator().manual_seed(700)
    x = torch.randn(4 * 32, 8, 128, generator=g) * 3
    for bits in (2, 4):
        for fn in (Q.kivi_quantize_keys, Q.kivi_quantize_values):
            for a, b in zip(fn(x, bits, 32), fn(x.cuda(), bits, 32)):
                assert torch.equal(a, b.cpu()), fn.__name__
    sc = Q.fp8_scales(x, True)
    assert torch.equal(sc, Q.fp8_scales(x.cuda(), True).cpu())
    assert torch.equal(Q.fp8_quantize(x, sc).view(torch.uint8),
                       Q.fp8_quantize(x.cuda(), sc.cuda()).cpu().view(torch.uint8))


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
