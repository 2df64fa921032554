"""FlashPrefill (block-sparse prefill attention, issue 17): sgl_kernel_sparse.flashprefill (the
references) and triton_flashprefill (the kernel). Kernel layer only, no server.

CPU, default suite:
- ``block_mask`` against a brute-force reading of its docstring (Python loops, float64):
  threshold, budget, both, sinks / local blocks, a chunk at an aligned and an unaligned offset,
  GQA, blocks that are not powers of two; ties to the lower block; a chunk's mask equals the
  whole prompt's rows; GQA mask == the MHA mask over repeated keys;
- ``block_sparse_attention`` with the keep-all mask == dense causal attention
  (``reference.attention_probs``) bit for bit; with any mask == dense attention whose masked-out
  logits are set to -inf (token mask built by loops); a row reading nothing -> zeros;
- the Triton kernel == the reference under the Triton interpreter (tiny shapes, one subprocess:
  ``python test_flashprefill_kernels.py --interp``, see interpreter_cases.py);
- the kernel compiled for sm_90 without a GPU (``bench/compile_report.py --groups prefill``);
- the dispatch (``sglang_sparse.kernels.sparse_prefill``) runs the reference on CPU.
GPU (``-m gpu``, skipped without CUDA): kernel == reference at fp16 / bf16, chunks, a 4K prompt.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "sgl-kernel-sparse" / "python") not in sys.path:  # the package from the checkout
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "python"))

from sgl_kernel_sparse import flashprefill as F  # noqa: E402
from sgl_kernel_sparse.reference import attention_probs  # noqa: E402

from interpreter_cases import Unsupported, interpreter_test, report, run_cases  # noqa: E402


def inputs(s, start, hq, hkv, d, dtype=torch.float32, seed=0, dv=None, spread=2.0):
    """A chunk ``q [s, Hq, D]`` at positions ``[start, start + s)`` and its keys / values
    ``[start + s, Hkv, D | Dv]``; ``spread`` sharpens the block softmax."""
    g = torch.Generator().manual_seed(seed)
    n = start + s
    q = (torch.randn(s, hq, d, generator=g) * spread).to(dtype)
    k = (torch.randn(n, hkv, d, generator=g) * spread).to(dtype)
    v = torch.randn(n, hkv, dv or d, generator=g).to(dtype)
    return q, k, v


def dense(q, k, v, start, scale=None):
    """Dense causal attention from ``reference.attention_probs``, out in q's dtype."""
    probs = attention_probs(q, k, start + torch.arange(q.shape[0]), scale)
    group = q.shape[1] // k.shape[1]
    return torch.einsum("hsn,nhd->shd", probs, v.float().repeat_interleave(group, dim=1)).to(q.dtype)


def close(got, want, dtype, what):
    atol, rtol = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 2e-2)}[dtype]
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {tuple(got.shape)}"
    err = (got.float() - want.float()).abs()
    bad = ~(err <= atol + rtol * want.float().abs())  # NaN counts as off
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off, max err {err.max():.3g}"


# ============================================================ block mask vs brute force


def brute_mask(q, k, block, sinks, local, threshold, budget, start, scale=None):
    """``block_mask``'s docstring, one query head and absolute query block at a time (float64)."""
    s, hq, d = q.shape
    n, hkv = k.shape[0], k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    qb0, last, n_kb = start // block, (start + s - 1) // block, math.ceil(n / block)
    out = torch.zeros(hq, last - qb0 + 1, n_kb, dtype=torch.bool)
    keep_all = (threshold is None and budget is None) or (threshold is not None and threshold >= 1)

    def mean(rows):
        return sum(rows) / len(rows)

    for h in range(hq):
        g = h // (hq // hkv)
        for a in range(qb0, last + 1):
            qm = mean([q[p - start, h].double() for p in range(max(start, a * block), min(start + s, (a + 1) * block))])
            logit = [float(qm @ mean([k[p, g].double() for p in range(j * block, min(n, (j + 1) * block))])) * scale
                     for j in range(a + 1)]
            e = [math.exp(x - max(logit)) for x in logit]
            p = [x / sum(e) for x in e]
            forced = {j for j in range(a + 1) if j < sinks or j > a - local}
            kept = set(range(a + 1)) if keep_all else set(forced)
            mass = sum(p[j] for j in forced)
            for j in sorted(set(range(a + 1)) - forced, key=lambda j: (-p[j], j)):
                if keep_all or (threshold is not None and mass >= threshold) or (budget is not None and len(kept) >= budget):
                    break
                kept.add(j)
                mass += p[j]
            out[h, a - qb0, sorted(kept)] = True
    return out


MASK_CASES = [  # s, start, block, hq, hkv, d, sinks, local, threshold, budget
    (48, 0, 8, 2, 2, 8, 1, 1, 0.5, None),
    (48, 0, 8, 4, 2, 8, 1, 2, 0.8, None),
    (40, 24, 8, 4, 1, 8, 2, 1, None, 5),  # chunk at an aligned offset, GQA 4:1
    (37, 21, 8, 4, 2, 16, 1, 1, 0.7, None),  # unaligned: partial first and last query blocks
    (37, 21, 8, 2, 1, 8, 0, 3, 0.9, 4),  # no sinks, both rules
    (30, 13, 5, 3, 3, 8, 1, 1, 0.6, None),  # block 5 (the reference takes any block)
    (64, 0, 8, 2, 1, 8, 1, 1, None, 0),  # budget 0: only the forced blocks
    (64, 0, 8, 2, 1, 8, 3, 2, 0.3, 2),  # forced blocks past the budget are kept
    (16, 50, 16, 2, 2, 8, 1, 1, 0.95, None),  # one partial query block far into the prompt
]


@pytest.mark.parametrize("case", MASK_CASES, ids=[f"c{i}" for i in range(len(MASK_CASES))])
def test_block_mask_matches_brute_force(case):
    s, start, block, hq, hkv, d, sinks, local, threshold, budget = case
    q, k, _ = inputs(s, start, hq, hkv, d, seed=s + start)
    got = F.block_mask(q, k, block, sinks, local, threshold, budget, start)
    want = brute_mask(q, k, block, sinks, local, threshold, budget, start)
    assert torch.equal(got, want), (got.int() - want.int()).nonzero().tolist()
    causal = F.keep_all_mask(s, hq, block, start)
    assert not (got & ~causal).any()
    if threshold is not None or budget is not None:
        assert (got.sum() < causal.sum()), "the case should drop something"


def test_block_scores_are_pooled_dot_products():
    q, k, _ = inputs(13, 6, 4, 2, 8)  # positions 6..18, block 4: query blocks 1..4, key blocks 0..4
    sc = F.block_scores(q, k, 4, start=6)
    assert sc.shape == (4, 4, 5)
    q_blk3 = q[12 - 6:16 - 6, 3].mean(0)  # absolute block 3 = positions 12..15, row 2
    k_blk4 = k[16:19, 1].mean(0)  # partial last key block: positions 16..18; head 3 -> KV head 1
    assert torch.allclose(sc[3, 2, 4], q_blk3 @ k_blk4 / math.sqrt(8), atol=1e-5)
    q_blk1 = q[0:2, 0].mean(0)  # partial first query block: positions 6, 7
    assert torch.allclose(sc[0, 0, 0], q_blk1 @ k[0:4, 0].mean(0) / math.sqrt(8), atol=1e-5)


def test_ties_go_to_the_lower_block():
    block, n_kb = 4, 6
    base = torch.randn(block, 2, 8)
    k = base.repeat(n_kb, 1, 1)  # identical key blocks: every score of a query block ties
    q = torch.randn(n_kb * block, 2, 8)
    got = F.block_mask(q, k, block, sinks_blocks=1, local_blocks=1, budget=3)
    assert got[:, 5].nonzero()[:, 1].view(2, -1).tolist() == [[0, 1, 5], [0, 1, 5]]
    assert torch.equal(got, brute_mask(q, k, block, 1, 1, None, 3, 0))
    top = F.block_mask(q, k, block, 1, 1, threshold=0.5)  # 1/6 each: 2 forced + 1 more reaches 1/2
    assert top[:, 5].nonzero()[:, 1].view(2, -1).tolist() == [[0, 1, 5], [0, 1, 5]]


def test_chunk_mask_equals_the_whole_prompt_rows():
    block, start, s = 8, 32, 24  # aligned chunk [32, 56): query blocks 4..6
    q, k, _ = inputs(start + s, 0, 4, 2, 8, seed=3)
    whole = F.block_mask(q, k, block, 1, 2, threshold=0.7)
    chunk = F.block_mask(q[start:], k, block, 1, 2, threshold=0.7, start=start)
    assert torch.equal(chunk, whole[:, start // block:])


def test_gqa_mask_equals_mha_over_repeated_keys():
    q, k, _ = inputs(40, 9, 6, 2, 8, seed=4)
    got = F.block_mask(q, k, 8, 1, 1, threshold=0.6, start=9)
    assert torch.equal(got, F.block_mask(q, k.repeat_interleave(3, dim=1), 8, 1, 1, threshold=0.6, start=9))


def test_keep_all_rules_and_refusals():
    q, k, _ = inputs(20, 5, 2, 1, 8)
    full = F.keep_all_mask(20, 2, 8, 5)
    for kw in ({}, {"threshold": 1.0}, {"budget": 99}, {"threshold": 1.5, "budget": 1}):
        assert torch.equal(F.block_mask(q, k, 8, **kw, start=5), full), kw
    with pytest.raises(ValueError):
        F.block_mask(q, k, 8, local_blocks=0, start=5)
    with pytest.raises(ValueError):
        F.block_mask(q, k, 8, start=4)  # k does not hold [0, start + s)
    assert F.block_mask(q[:0], k[:5], 8, threshold=0.5, start=5).shape == (2, 0, 1)


# ============================================================ attention references


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,start,block,hq,hkv", [(40, 0, 8, 4, 2), (37, 21, 16, 4, 1), (9, 30, 5, 2, 2)])
def test_keep_all_equals_dense_exactly(dtype, s, start, block, hq, hkv):
    q, k, v = inputs(s, start, hq, hkv, 16, dtype, seed=7, dv=12)
    got = F.block_sparse_attention(q, k, v, F.keep_all_mask(s, hq, block, start), block, start, scale=0.3)
    assert torch.equal(got, dense(q, k, v, start, scale=0.3))


def masked_dense(q, k, v, mask, block, start):
    """Dense attention with the logits of dropped blocks (and future keys) set to -inf, the token
    mask read from the block mask by loops; fp32."""
    s, hq, d = q.shape
    n, group = k.shape[0], hq // k.shape[1]
    out = torch.zeros(s, hq, v.shape[2])
    for h in range(hq):
        for i in range(s):
            pos = start + i
            logit = torch.full((n,), float("-inf"))
            for m in range(pos + 1):
                if mask[h, pos // block - start // block, m // block]:
                    logit[m] = q[i, h].float() @ k[m, h // group].float() / math.sqrt(d)
            if logit.isfinite().any():
                out[i, h] = torch.softmax(logit, 0) @ v[:, h // group].float()
    return out


@pytest.mark.parametrize("case", [(40, 0, 8, 4, 2, 0.6, None), (37, 21, 8, 4, 1, None, 2), (30, 13, 5, 2, 2, 0.5, 3)])
def test_masked_reference_equals_dense_with_minus_inf(case):
    s, start, block, hq, hkv, threshold, budget = case
    q, k, v = inputs(s, start, hq, hkv, 8, seed=11)
    mask = F.block_mask(q, k, block, 1, 1, threshold, budget, start)
    assert not torch.equal(mask, F.keep_all_mask(s, hq, block, start))
    got = F.block_sparse_attention(q, k, v, mask, block, start)
    assert torch.allclose(got, masked_dense(q, k, v, mask, block, start), atol=1e-5, rtol=1e-5)


def test_a_query_reading_nothing_gets_zeros():
    q, k, v = inputs(16, 0, 2, 1, 8)
    mask = F.keep_all_mask(16, 2, 8)
    mask[1, 1] = False  # head 1, block 1 (positions 8..15) reads nothing
    got = F.block_sparse_attention(q, k, v, mask, 8)
    assert (got[8:, 1] == 0).all() and not got.isnan().any()
    assert torch.equal(got[:, 0], dense(q, k, v, 0)[:, 0])


def test_dispatch_runs_the_reference_on_cpu():
    from sglang_sparse.kernels import sparse_prefill as SP

    q, k, v = inputs(37, 21, 4, 2, 16, seed=12)
    mask = SP.flashprefill_block_mask(q, k, 8, 1, 2, threshold=0.8, start=21)
    assert torch.equal(mask, F.block_mask(q, k, 8, 1, 2, 0.8, None, 21))
    want = F.block_sparse_attention(q, k, v, mask, 8, 21)
    assert torch.equal(SP.block_sparse_prefill(q, k, v, mask, 8, 21), want)
    assert torch.equal(SP.flashprefill_attention(q, k, v, 8, 1, 2, threshold=0.8, start=21), want)


# ============================================================ Triton, interpreter (subprocess)


def _kernel_case(T, dtype, s, start, block, hq, hkv, d, threshold=None, budget=None, dv=None,
                 block_n=None, strided=False, seed=0):
    q, k, v = inputs(s, start, hq, hkv, d, dtype, seed, dv)
    if strided:  # q a view with a wider row; k / v views of one fused buffer
        q = torch.cat([q, q], dim=-1)[..., :d]
        kv = torch.stack([k, v], dim=1)  # needs dv == d
        k, v = kv[:, 0], kv[:, 1]
    mask = F.block_mask(q, k, block, 1, 1, threshold, budget, start)
    got = T.block_sparse_attention(q, k, v, mask, block, start, block_n=block_n)
    close(got, F.block_sparse_attention(q, k, v, mask, block, start), dtype, f"s={s} start={start}")


def case_fp32_gqa2_prompt_threshold(T):
    _kernel_case(T, torch.float32, 40, 0, 16, 4, 2, 32, threshold=0.6)


def case_fp16_gqa4_unaligned_chunk_budget(T):
    _kernel_case(T, torch.float16, 37, 21, 16, 4, 1, 16, budget=2)


def case_fp32_aligned_chunk_subtiles_d24_dv16(T):
    _kernel_case(T, torch.float32, 40, 32, 32, 2, 2, 24, threshold=0.7, dv=16, block_n=16)


def case_fp16_keep_all_strided(T):
    _kernel_case(T, torch.float16, 33, 16, 16, 2, 1, 16, strided=True, seed=3)


def case_bf16_chunk(T):
    if _bf16_dot_broken():
        raise Unsupported("Triton 3.8 interpreter computes bf16 tl.dot on raw uint16 bits; bf16 is covered "
                          "by the GPU tests")
    _kernel_case(T, torch.bfloat16, 30, 10, 16, 2, 1, 16, threshold=0.6)


def case_empty_row_empty_chunk_and_refusals(T):
    q, k, v = inputs(32, 0, 2, 1, 16)
    mask = F.keep_all_mask(32, 2, 16)
    mask[1, 1] = False
    got = T.block_sparse_attention(q, k, v, mask, 16)
    close(got, F.block_sparse_attention(q, k, v, mask, 16), torch.float32, "empty row")
    assert (got[16:, 1] == 0).all()
    assert T.block_sparse_attention(q[:0], k[:0], v[:0], mask[:, :0, :0], 16).shape == (0, 2, 16)
    for bad in (dict(block=8), dict(block=24), dict(block=16, block_n=32)):
        try:
            T.block_sparse_attention(q, k, v, F.keep_all_mask(32, 2, bad["block"]), **bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} must be refused")


def _bf16_dot_broken():
    """Triton 3.8's interpreter multiplies bf16 tl.dot operands as raw uint16 bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(X, Y):
        i = tl.arange(0, 16)
        x = tl.load(X + i[:, None] * 16 + i[None, :])
        tl.store(Y + i[:, None] * 16 + i[None, :], tl.dot(x, x))

    y = torch.zeros(16, 16)
    probe[(1,)](torch.eye(16).to(torch.bfloat16), y)
    return not torch.equal(y, torch.eye(16))


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """fp16, blocks of 64 and 128 (bf16 too: ``python sgl-kernel-sparse/bench/compile_report.py
    --groups prefill``)."""
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, str(ROOT / "sgl-kernel-sparse" / "bench" / "compile_report.py"),
                          "--groups", "prefill", "--dtypes", "fp16", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    rows = json.loads(out.read_text())
    assert {(r["kernel"], r["constexprs"]["BLOCK"]) for r in rows} == {("_flashprefill_kernel", 64),
                                                                       ("_flashprefill_kernel", 128)}


# ============================================================ GPU: compiled kernel, real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("s,start,block", [(1024, 0, 64), (777, 1000, 128), (300, 2048, 64)])
def test_gpu_kernel_matches_reference(dtype, s, start, block):
    from sgl_kernel_sparse.triton_flashprefill import block_sparse_attention

    q, k, v = (t.cuda() for t in inputs(s, start, 32, 8, 128, dtype, seed=s, spread=1.0))
    for kw in (dict(threshold=0.9), dict(budget=4), dict()):
        mask = F.block_mask(q, k, block, 1, 2, start=start, **kw)
        close(block_sparse_attention(q, k, v, mask, block, start), F.block_sparse_attention(q, k, v, mask, block, start),
              dtype, f"{kw}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_4k_prompt_and_dispatch(dtype):
    from sglang_sparse.kernels.sparse_prefill import block_sparse_prefill, flashprefill_block_mask

    q, k, v = (t.cuda() for t in inputs(4096, 0, 8, 2, 128, dtype, seed=40, spread=1.0))
    mask = flashprefill_block_mask(q, k, 128, 1, 2, threshold=0.9)
    assert mask.sum() < F.keep_all_mask(4096, 8, 128).sum()
    close(block_sparse_prefill(q, k, v, mask, 128), F.block_sparse_attention(q, k, v, mask, 128), dtype, "4K sparse")
    full = F.keep_all_mask(4096, 8, 128, device="cuda")
    close(block_sparse_prefill(q, k, v, full, 128), dense(q, k, v, 0), dtype, "4K keep-all vs dense")


if __name__ == "__main__" and "--interp" in sys.argv:
    from sgl_kernel_sparse.triton_flashprefill import block_sparse_attention

    report(run_cases(CASES, SimpleNamespace(block_sparse_attention=block_sparse_attention)))
