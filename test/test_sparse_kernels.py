"""sgl_kernel_sparse (sgl-kernel-sparse/): Triton kernels against the plain-torch references.

CPU, default suite:
- the package's references (the one definition of each formula) against loop-based readings of
  the formulas (in process, milliseconds; SnapKV and Quest selection also in
  test_reference_kernels.py);
- every Triton kernel under the Triton interpreter on small shapes. ``triton.jit`` reads
  ``TRITON_INTERPRET`` when a kernel module is imported, so the interpreter cases run in *one*
  subprocess (``python test_sparse_kernels.py --interp``) with the variable set; each case is
  reported back to its own pytest test (fail / skip with the reason);
- every kernel compiled for sm_90 (H100/H200) without a GPU (``bench/compile_report.py``):
  compile errors the interpreter cannot see, and register spills.
GPU (``-m gpu``, skipped without CUDA): compiled kernels on realistic shapes vs the references.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PKG_ROOT = ROOT / "sgl-kernel-sparse"
if str(PKG_ROOT / "python") not in sys.path:  # the package is used from the checkout
    sys.path.insert(0, str(PKG_ROOT / "python"))

from sgl_kernel_sparse import reference as R  # noqa: E402


# ============================================================ shared input builders


def pool(num_slots, hkv, d, dtype, g, fused=True):
    """K and V pools ``[num_slots, Hkv, D]``; ``fused``: views into one ``[slots, 2, Hkv, D]``
    buffer, so the slot stride is not ``Hkv*D`` (exercises stride handling)."""
    if fused:
        buf = torch.randn(num_slots, 2, hkv, d, generator=g).to(dtype)
        return buf[:, 0], buf[:, 1]
    return (torch.randn(num_slots, hkv, d, generator=g).to(dtype),
            torch.randn(num_slots, hkv, d, generator=g).to(dtype))


def req_table(n_req, ctx, num_slots, g):
    """req_to_token ``[n_req, ctx]`` int32: distinct, shuffled slots (positions != slots)."""
    return torch.randperm(num_slots, generator=g)[: n_req * ctx].view(n_req, ctx).to(torch.int32)


def request_pool(b, spare, ctx, pad, hkv, d, dtype, g):
    """A test batch's KV pool, slot table and request rows: ``b + spare`` table rows of ``ctx``
    distinct shuffled slots in a pool of ``(b + spare) * ctx + pad`` slots; ``b`` of the rows used,
    in random order."""
    n_req = b + spare
    num_slots = n_req * ctx + pad
    k, v = pool(num_slots, hkv, d, dtype, g)
    r2t = req_table(n_req, ctx, num_slots, g)
    return k, v, r2t, torch.randperm(n_req, generator=g)[:b]


def decode_inputs(b, hq, hkv, d, n, ctx, dtype, seed, idx_dtype=torch.int64):
    g = torch.Generator().manual_seed(seed)
    k, v, r2t, req_rows = request_pool(b, 2, ctx, 5, hkv, d, dtype, g)
    q = torch.randn(b, hq, 2 * d, generator=g).to(dtype)[..., :d]  # non-contiguous heads
    rows = torch.randint(0, ctx, (b, hq, n), generator=g)
    valid = torch.rand(b, hq, n, generator=g) > 0.3
    valid[0, 1] = False  # a head that reads nothing -> zeros
    rows = torch.where(valid, rows, 10**6).to(idx_dtype)  # padding rows hold garbage
    return q, k, v, r2t, req_rows, rows, valid


def paged_inputs(b, hq, hkv, d, page, n_sel, dtype, seed, seq_lens):
    g = torch.Generator().manual_seed(seed)
    ctx = max(seq_lens) + page
    k, v, r2t, req_rows = request_pool(b, 1, ctx, 3, hkv, d, dtype, g)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    seq = torch.tensor(seq_lens)
    n_pages = (seq + page - 1) // page
    page_ids = torch.full((b, hq, n_sel), -1, dtype=torch.int32)  # [B, Hq, n_sel], -1 = padding
    for i in range(b):
        n = min(n_sel, int(n_pages[i]))  # short requests: fewer pages than n_sel
        for h in range(hq):
            page_ids[i, h, :n] = torch.randperm(int(n_pages[i]), generator=g)[:n].to(torch.int32)
    page_ids[0, 0, -1] = -1  # padding
    page_ids[0, 1, :] = -1  # a head with no page
    page_ids[-1, 0, 0] = n_pages[-1] - 1  # the partial last page
    return q, k, v, r2t, req_rows, page_ids, seq


def rows_tail_inputs(b, hq, hkv, d, n_sel, ctx, dtype, seed, tails):
    """OmniKV's view: ``sel_rows [B, n_sel]`` (chosen rows below ``tail_start``, ``-1`` padding)
    and a tail ``[tail_start, seq_lens)`` per request, ``tails`` its lengths (0: none)."""
    g = torch.Generator().manual_seed(seed)
    k, v, r2t, req_rows = request_pool(b, 1, ctx, 7, hkv, d, dtype, g)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    tail_start = torch.randint(n_sel // 2, ctx - max(tails) - 1, (b,), generator=g)
    seq = tail_start + torch.tensor(tails)
    sel = torch.full((b, n_sel), -1, dtype=torch.int32)
    for i in range(b):
        m = min(n_sel, int(tail_start[i]))
        sel[i, :m] = torch.randperm(int(tail_start[i]), generator=g)[:m].to(torch.int32)
    sel[0, n_sel // 3] = -1  # padding in the middle
    return q, k, v, r2t, req_rows, sel, tail_start.to(torch.int32), seq.to(torch.int32)


def close(got, want, dtype, what):
    tol = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 2e-2)}
    atol, rtol = tol[dtype]
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs()
    bad = err > atol + rtol * want.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off, max err {err.max():.3g}"


# ============================================================ references by definition


def _softmax_attention(q, k, v, scale):
    """One query ``[D]`` over keys / values ``[N, D]``, by the definition."""
    w = torch.softmax((k.float() @ q.float()) * scale, dim=0)
    return w @ v.float()


def test_decode_reference_by_definition():
    q, k, v, r2t, req_rows, rows, valid = decode_inputs(3, 4, 2, 16, 23, 40, torch.float32, 1)
    out = R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid, scale=0.3)
    group = 2
    for b in range(3):
        for h in range(4):
            if not valid[b, h].any():
                assert out[b, h].abs().max() == 0, "a head with no valid row must output zeros"
                continue
            sel = rows[b, h][valid[b, h]].clamp(max=39)
            slots = r2t[req_rows[b], sel].long()
            want = _softmax_attention(q[b, h], k[slots, h // group], v[slots, h // group], 0.3)
            torch.testing.assert_close(out[b, h], want, atol=1e-6, rtol=1e-5)
    # default scale 1/sqrt(d)
    out = R.sparse_decode_attention(q[:1], k, v, r2t, req_rows[:1], rows[:1], valid[:1])
    sel = rows[0, 0][valid[0, 0]]
    slots = r2t[req_rows[0], sel].long()
    torch.testing.assert_close(out[0, 0], _softmax_attention(q[0, 0], k[slots, 0], v[slots, 0], 16 ** -0.5),
                               atol=1e-6, rtol=1e-5)


def test_pages_to_rows_by_definition():
    page_ids = torch.tensor([[[2, 0, -1]], [[1, 3, 2]]])
    rows, valid = R.pages_to_rows(page_ids, torch.tensor([10, 15]), 4)
    want = []
    for b, seq_len in enumerate((10, 15)):
        want.append([(p * 4 + j) if p >= 0 and p * 4 + j < seq_len else None
                     for p in page_ids[b, 0].tolist() for j in range(4)])
    got = [[r if ok else None for r, ok in zip(rows[b, 0].tolist(), valid[b, 0].tolist())]
           for b in range(2)]
    assert got == want


def test_quest_scores_and_selection_by_definition():
    g = torch.Generator().manual_seed(4)
    b, hq, hkv, d, p_max = 3, 8, 2, 16, 11
    kmin = torch.randn(4, p_max, hkv, d, generator=g)
    kmax = kmin + torch.rand(4, p_max, hkv, d, generator=g)
    q = torch.randn(b, hq, d, generator=g)
    n_pages = torch.tensor([11, 5, 2])
    rows = torch.tensor([3, 0, 1])
    scores = R.quest_page_scores(q, kmin, kmax, n_pages, summary_rows=rows)
    n_sel = torch.tensor([min(4, int(n)) for n in n_pages])  # 4 pages per head, capped by n_pages
    sel = R.quest_select_pages(scores, n_sel)
    assert sel.shape == (b, hq, 4) and sel.dtype == torch.int32
    for i in range(b):
        n = int(n_pages[i])
        mn, mx = kmin[rows[i], :n], kmax[rows[i], :n]
        for h in range(hq):  # sum_c max(q_c * M_c, q_c * m_c), KV head h // (hq // hkv)
            kv = h // (hq // hkv)
            want = torch.stack([torch.maximum(q[i, h] * mx[p, kv], q[i, h] * mn[p, kv]).sum() for p in range(n)])
            torch.testing.assert_close(scores[i, h, :n], want, atol=1e-5, rtol=1e-5)
            order = sorted(range(n), key=lambda p: (-float(scores[i, h, p]), p))[: int(n_sel[i])]
            assert sel[i, h, : int(n_sel[i])].tolist() == sorted(order), f"request {i} head {h}"
        assert torch.isneginf(scores[i, :, n:]).all()
        assert (sel[i, :, int(n_sel[i]):] == -1).all(), "padding must be -1"


def test_quest_selection_ties_go_to_lower_page():
    scores = torch.tensor([[[1.0, 3.0, 3.0, 1.0, 3.0, 2.0, float("-inf")]]])
    assert R.quest_select_pages(scores, 2).tolist() == [[[1, 2]]]
    assert R.quest_select_pages(scores, 4).tolist() == [[[1, 2, 4, 5]]]
    flat = torch.zeros(1, 2, 9)
    assert R.quest_select_pages(flat, 3).tolist() == [[[0, 1, 2], [0, 1, 2]]]


def test_snapkv_dispatch_reads_the_pool_through_slots():
    """The dispatched selection (Triton on CUDA, here the reference) from the KV pool and the
    prompt's slots equals the selection from the gathered keys."""
    import sgl_kernel_sparse

    g = torch.Generator().manual_seed(6)
    k_pool = torch.randn(90, 2, 8, generator=g)
    slots = torch.randperm(90, generator=g)[:40]
    q_win = torch.randn(8, 6, 8, generator=g)
    got = sgl_kernel_sparse.snapkv_keep_indices(q_win, k_pool, 16, 4, 5, slots=slots)
    assert torch.equal(got, R.snapkv_keep_indices(q_win, k_pool[slots], 16, 4, 5))


def test_compact_reference_overlapping_ranges():
    g = torch.Generator().manual_seed(5)
    k, v = pool(30, 2, 4, torch.float32, g, fused=False)
    src = torch.tensor([[3, 5, 6, 9, 12], [2, 3, 4, 10, 11]])  # overlaps dst = 2..6
    dst = torch.arange(2, 7)
    k0, v0 = k.clone(), v.clone()
    R.compact_kv(k, v, src, dst)
    for h in range(2):
        for i in range(5):
            assert torch.equal(k[dst[i], h], k0[src[h, i], h])
            assert torch.equal(v[dst[i], h], v0[src[h, i], h])
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[dst] = False
    assert torch.equal(k[untouched], k0[untouched])


def test_dispatch_uses_reference_on_cpu():
    import sgl_kernel_sparse as sks

    q, k, v, r2t, req_rows, rows, valid = decode_inputs(2, 4, 2, 16, 9, 20, torch.float32, 6)
    assert not sks.use_triton(q, k)
    got = sks.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid, num_splits=2)
    assert torch.equal(got, R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid))


def test_package_imports_neither_sglang_nor_sglang_sparse():
    bad = []
    for path in (PKG_ROOT / "python" / "sgl_kernel_sparse").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            bad += [f"{path.name}: {n}" for n in names
                    if n.split(".")[0] in ("sglang", "sglang_sparse")]
    assert bad == []


def test_bench_exits_clearly_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the benchmark would run")
    res = subprocess.run([sys.executable, str(PKG_ROOT / "bench" / "bench_kernels.py"),
                          "--out", str(tmp_path / "r.json")], capture_output=True, text=True)
    assert res.returncode != 0 and "CUDA" in res.stderr, res.stderr
    assert not (tmp_path / "r.json").exists()


# ============================================================ Triton interpreter cases
# Each case runs in the subprocess (TRITON_INTERPRET=1) with T = sgl_kernel_sparse.triton_ops.


from interpreter_cases import Unsupported, interpreter_test, report, run_cases  # noqa: E402


def case_interpreter_active(T):
    from triton.runtime.interpreter import InterpretedFunction

    from sgl_kernel_sparse import (triton_cells, triton_compact, triton_decode, triton_omnikv, triton_paged_gqa,
                                   triton_quest, triton_select, triton_snapkv)

    kernels = [triton_decode._decode_partial_kernel, triton_decode._decode_reduce_kernel,
               triton_cells._cells_partial_kernel, triton_omnikv._rows_tail_partial_kernel,
               triton_omnikv._token_logits_kernel,
               triton_quest._quest_scores_kernel, triton_quest._fold_decode_keys_kernel,
               triton_select._select_top_kernel, triton_select._select_top_radix_kernel,
               triton_paged_gqa._paged_gqa_partial_kernel,
               triton_snapkv._snapkv_lse_kernel, triton_snapkv._snapkv_score_kernel,
               triton_compact._copy_rows_kernel, triton_compact._compact_segments_kernel]
    assert all(isinstance(k, InterpretedFunction) for k in kernels), "kernels are not interpreted"


def _decode_case(T, dtype, hq, hkv, d, n, idx_dtype, seed):
    inputs = decode_inputs(3, hq, hkv, d, n, 50, dtype, seed, idx_dtype)
    q, k, v, r2t, req_rows, rows, valid = inputs
    want = R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid)
    for splits in (1, 3):  # 3: split-K partials + the reduce kernel
        got = T.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid,
                                        num_splits=splits, block_n=16)
        close(got, want, dtype, f"splits={splits}")
        assert (got[0, 1] == 0).all(), "head with no valid row must be zeros"
    got = T.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid)  # default heuristics
    close(got, want, dtype, "default splits")


def case_decode_rows_fp32_gqa2(T):
    _decode_case(T, torch.float32, 4, 2, 32, 37, torch.int64, 10)


def case_decode_rows_fp16_gqa4_int32(T):
    _decode_case(T, torch.float16, 8, 2, 32, 45, torch.int32, 11)


def case_decode_rows_bf16_mha_d48(T):
    _decode_case(T, torch.bfloat16, 2, 2, 48, 21, torch.int64, 12)  # D not a power of 2


def case_decode_rows_scale_and_long_n(T):
    q, k, v, r2t, req_rows, rows, valid = decode_inputs(2, 4, 1, 16, 200, 120, torch.float32, 13)
    want = R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid, scale=0.7)
    got = T.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid, scale=0.7,
                                    num_splits=5, block_n=16)
    close(got, want, torch.float32, "scale 0.7, 5 splits")


def _paged_case(T, dtype, page, seed):
    seq_lens = [5 * page + 1, 3 * page, 4 * page - 1]  # partial last pages
    inputs = paged_inputs(3, 4, 2, 32, page, 3, dtype, seed, seq_lens)
    q, k, v, r2t, req_rows, page_ids, seq = inputs
    want = R.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
    rows, valid = R.pages_to_rows(page_ids, seq, page)
    close(want, R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid), dtype, "ref")
    for splits in (1, 2):
        got = T.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page,
                                              num_splits=splits, block_n=8)
        close(got, want, dtype, f"page={page} splits={splits}")
        assert (got[0, 1] == 0).all()


def case_paged_fp32_page4(T):
    _paged_case(T, torch.float32, 4, 20)


def case_paged_bf16_page3(T):
    _paged_case(T, torch.bfloat16, 3, 21)  # page size not a power of 2


def case_paged_fp16_page16(T):
    _paged_case(T, torch.float16, 16, 22)


def _aligned_table(n_req, ctx, page, g):
    """Slot-table rows made of whole, aligned pool pages in random order (SGLang with
    ``--page-size page``): row-page p of row r is pool page ``perm[r * P + p] + 1`` (page 0 spare)."""
    n_pages = ctx // page
    perm = torch.randperm(n_req * n_pages, generator=g).view(n_req, n_pages, 1) + 1
    return (perm * page + torch.arange(page)).view(n_req, ctx).int()


def case_paged_launch_variants_agree(T):
    """Every launch option of the paged kernel gives the reference's output: the page ids of the
    next tile loaded ahead (``prefetch``), one slot-table entry per page on an aligned table
    (``aligned``), Triton loop pipelining (``num_stages``), split-K, on partial last pages, an
    empty head and padding; and ``aligned`` on an aligned table equals the per-row lookup."""
    page = 4
    seq_lens = [5 * page + 1, 3 * page, 4 * page - 1]
    q, k, v, _, req_rows, page_ids, seq = paged_inputs(3, 4, 2, 32, page, 3, torch.float32, 23, seq_lens)
    g = torch.Generator().manual_seed(24)
    ctx = (max(seq_lens) // page + 2) * page
    r2t = _aligned_table(4, ctx, page, g)
    k = torch.randn(int(r2t.max()) + page, 2, 32, generator=g)
    v = torch.randn_like(k)
    req_rows = torch.tensor([2, 0, 3])
    want = R.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
    for prefetch in (False, True):
        for aligned in (False, True):
            for stages, splits, block_n in ((0, 1, 8), (2, 3, 4), (0, 2, 16)):
                got = T.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page,
                                                      num_splits=splits, block_n=block_n, prefetch=prefetch,
                                                      aligned=aligned, num_stages=stages, num_warps=2)
                close(got, want, torch.float32, f"prefetch={prefetch} aligned={aligned} stages={stages} "
                      f"splits={splits} block_n={block_n}")
                assert (got[0, 1] == 0).all(), "head with no page must be zeros"


def case_paged_gqa_equals_the_expanded_reference(T):
    """One page set per KV head (Quest ``--sparse-select-per kv_head``): the GQA kernel (each page
    loaded once for the group, ``tl.dot`` over a padded query tile) gives the per-query-head
    reference over the expanded page ids; aligned and per-row lookups, split-K, pipelining, the next
    tile's slots ahead (``prefetch``: on, off, and by default), partial last pages, padding, a KV
    head with no page, groups of 4 and 1; fp32, fp16, bf16."""
    from sgl_kernel_sparse.triton_decode import plan_splits

    page, n_sel = 4, 12  # 48 entries per KV head: 3 tiles of 16, so up to 3 splits
    seq_lens = [13 * page + 1, 12 * page, 11 * page - 1]
    g = torch.Generator().manual_seed(25)
    ctx = (max(seq_lens) // page + 2) * page
    r2t = _aligned_table(4, ctx, page, g)
    req_rows = torch.tensor([2, 0, 3])
    seq = torch.tensor(seq_lens)
    for splits in (2, 3):  # the split-K variants below really run split
        assert plan_splits(6, n_sel * page, 32, torch.device("cpu"), 16, splits)[1] == splits
    for dtype, hq, hkv in ((torch.float32, 8, 2), (torch.float16, 8, 2), (torch.bfloat16, 2, 2)):
        _, _, _, _, _, page_ids, _ = paged_inputs(3, hkv, hkv, 32, page, n_sel, dtype, 26, seq_lens)
        q = torch.randn(3, hq, 32, generator=g).to(dtype)
        k = torch.randn(int(r2t.max()) + page, hkv, 32, generator=g).to(dtype)
        v = torch.randn_like(k)
        want = R.paged_gqa_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
        close(want, R.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids.repeat_interleave(hq // hkv, 1),
                                                    seq, page), dtype, "reference expands")
        for aligned, splits, stages, prefetch in ((False, 1, 0, False), (True, 3, 0, False), (True, 2, 2, None),
                                                  (True, 3, 0, None), (False, 2, 0, True), (True, 1, 0, True)):
            got = T.paged_gqa_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page, num_splits=splits,
                                               block_n=16, aligned=aligned, num_stages=stages, num_warps=2,
                                               prefetch=prefetch)
            close(got, want, dtype, f"{dtype} hq={hq} aligned={aligned} splits={splits} stages={stages} "
                  f"prefetch={prefetch}")
            assert (got[0, (hq // hkv):2 * (hq // hkv)] == 0).all(), "a KV head with no page: zeros"


def case_select_top_radix_equals_bits(T):
    """``select_top(method="radix")`` (4 byte-wide histogram passes) and ``method="nibble"`` (8
    passes of 16 counts, sweeping the row in slices) give the bitwise kernel's and
    the stable sort's indices: ties across a whole byte, bf16-rounded scores, +inf, short rows
    with fewer finite pages than k, all -inf rows, k of 1 and k past the row."""
    g = torch.Generator().manual_seed(73)
    s = torch.randn(5, 2100, generator=g)
    s[1] = s[1].to(torch.bfloat16).float() * 1e-3  # many equal values, equal high bytes
    s[2, 90:] = float("-inf")
    s[2, 5] = float("inf")
    s[3] = torch.zeros(2100)
    s[3, ::3] = -0.0  # -0.0 and +0.0 around the cut: the stable sort ties them (lower index first)
    s[3, 1000:1005] = 1.0
    s[4] = float("-inf")
    for k in (1, 128, 200, 3000):
        want = R.quest_select_pages(s.view(1, 5, -1), k).long()[0]
        for method, warps in (("bits", None), ("radix", None), ("nibble", None), ("nibble", 16)):
            # nibble sweeps 256 (default warps) or 512 (16 warps) keys at a time: a ragged last slice of 2,100
            got = T.select_top(s, k, method=method, num_warps=warps)
            assert torch.equal(got, want), (method, warps, k)
    try:
        T.select_top(s, 4, method="heap")
    except ValueError as exc:
        assert "radix" in str(exc)
    else:
        raise AssertionError("an unknown method must be refused")


def case_rows_tail_by_definition(T):
    """The reference reads exactly the chosen rows and the tail (dense masked attention)."""
    q, k, v, r2t, req_rows, sel, t0, seq = rows_tail_inputs(2, 4, 2, 16, 6, 40, torch.float32, 70, (3, 0))
    out = R.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq)
    for b in range(2):
        pos = [x for x in sel[b].tolist() if x >= 0] + list(range(int(t0[b]), int(seq[b])))
        slots = r2t[req_rows[b], pos].long()
        for h in range(4):
            want = _softmax_attention(q[b, h], k[slots, h // 2], v[slots, h // 2], 16 ** -0.5)
            torch.testing.assert_close(out[b, h], want, atol=1e-5, rtol=1e-5)


def _rows_tail_case(T, dtype, hq, hkv, d, tails, seed):
    q, k, v, r2t, req_rows, sel, t0, seq = rows_tail_inputs(len(tails), hq, hkv, d, 20, 90, dtype, seed, tails)
    want = R.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq)
    for splits in (1, 3):  # 3: shares per request, split-K partials + the reduce kernel
        got = T.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq, num_splits=splits, block_n=8)
        close(got, want, dtype, f"splits={splits}")
    close(T.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq), want, dtype, "default splits")


def case_rows_tail_fp32_gqa2(T):
    _rows_tail_case(T, torch.float32, 4, 2, 32, (5, 0, 37), 71)


def case_rows_tail_bf16_mha_d48(T):
    _rows_tail_case(T, torch.bfloat16, 2, 2, 48, (1, 12), 72)


def case_rows_tail_fp16_gqa4(T):
    """The 8B shape's group of 4 query heads per KV head (one program serves the group)."""
    _rows_tail_case(T, torch.float16, 8, 2, 64, (0, 3, 40), 80)


def case_token_logits(T):
    for dtype, hq, hkv, d in ((torch.float32, 4, 2, 32), (torch.float16, 6, 3, 48)):
        q, k, _, r2t, req_rows, _, _, seq = rows_tail_inputs(3, hq, hkv, d, 4, 70, dtype, 73, (2, 0, 9))
        seq[1] = 70  # the whole table row
        want = R.token_logits(q, k, r2t, req_rows, seq, scale=0.3)
        for bl in (16, 64):
            got = T.token_logits(q, k, r2t, req_rows, seq, scale=0.3, block_l=bl)
            assert torch.equal(torch.isinf(got), torch.isinf(want)), "-inf exactly past each request"
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def case_quest_scores(T):
    g = torch.Generator().manual_seed(33)
    for qdt, sdt, hq, hkv, d in ((torch.float32, torch.float32, 8, 2, 24),
                                 (torch.float16, torch.float32, 4, 4, 32),
                                 (torch.bfloat16, torch.bfloat16, 6, 2, 16)):
        kmin = torch.randn(5, 13, hkv, d, generator=g)
        kmax = (kmin + torch.rand(5, 13, hkv, d, generator=g)).to(sdt)
        kmin = kmin.to(sdt)
        kmin[4, 9:] = float("nan")  # pages past n_pages may hold anything
        q = torch.randn(3, hq, d, generator=g).to(qdt)
        n_pages = torch.tensor([13, 9, 1])
        rows = torch.tensor([2, 4, 0])
        want = R.quest_page_scores(q, kmin, kmax, n_pages, summary_rows=rows)
        for bp in (None, 8):
            got = T.quest_page_scores(q, kmin, kmax, n_pages, summary_rows=rows, block_p=bp)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        got = T.quest_page_scores(q[:2], kmin[:2], kmax[:2], n_pages[:2])  # default rows = b
        torch.testing.assert_close(got, R.quest_page_scores(q[:2], kmin[:2], kmax[:2], n_pages[:2]))


def case_quest_tied_pages_pick_lowest(T):
    kmin = torch.zeros(1, 10, 1, 8)
    kmax = torch.ones(1, 10, 1, 8)
    kmax[0, 7] = 2.0  # the one clear winner
    q = torch.ones(1, 2, 8)
    scores = T.quest_page_scores(q, kmin, kmax, torch.tensor([10]))
    assert R.quest_select_pages(scores, 3).tolist() == [[[0, 1, 7], [0, 1, 7]]]


def _bf16_dot_broken():
    """Triton 3.8's interpreter multiplies bf16 tl.dot operands as raw uint16 bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def probe(X, Y):
        i = tl.arange(0, 16)
        x = tl.load(X + i[:, None] * 16 + i[None, :])
        tl.store(Y + i[:, None] * 16 + i[None, :], tl.dot(x, x))

    x = torch.eye(16).to(torch.bfloat16)
    y = torch.zeros(16, 16)
    probe[(1,)](x, y)
    return not torch.equal(y, torch.eye(16))


def _snapkv_case(T, dtype, hq, hkv, d, length, w, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(length, hkv, d, generator=g).to(dtype)
    q_win = torch.randn(w, hq, d, generator=g).to(dtype)
    want = R.snapkv_window_scores(q_win, k)
    tol = dict(atol=1e-6, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-5, rtol=1e-3)
    for bl in (None, 16):
        torch.testing.assert_close(T.snapkv_window_scores(q_win, k, block_l=bl), want, **tol)
    # keys read from a KV pool through slots (a chunked prefill's keys stay in the pool)
    pool_k = torch.randn(length + 30, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(length + 30, generator=g)[:length]
    pool_k[slots] = k
    torch.testing.assert_close(T.snapkv_window_scores(q_win, pool_k, slots=slots), want, **tol)
    torch.testing.assert_close(T.snapkv_window_scores(q_win, k, scale=0.2),
                               R.snapkv_window_scores(q_win, k, scale=0.2), **tol)


def case_snapkv_fp32_gqa3(T):
    _snapkv_case(T, torch.float32, 6, 2, 16, 50, 5, 40)


def case_snapkv_fp16_mha_w_eq_l(T):
    _snapkv_case(T, torch.float16, 2, 2, 32, 20, 20, 41)  # window = the whole prompt
    _snapkv_case(T, torch.float16, 8, 2, 24, 37, 17, 42)  # W > 16, D not a power of 2


def case_snapkv_bf16(T):
    if _bf16_dot_broken():
        raise Unsupported("Triton 3.8 interpreter computes bf16 tl.dot on raw uint16 bits; "
                          "bf16 SnapKV is covered by the GPU tests")
    _snapkv_case(T, torch.bfloat16, 4, 2, 16, 40, 8, 43)


def _fp8_pool(n_rows, k, slots, g):
    """An fp8 e4m3 pool (SGLang's ``--kv-cache-dtype fp8_e4m3``) of ``n_rows`` rows holding the fp8
    keys ``k`` at ``slots`` (written through a uint8 view: fp8 has no index_put on every device)."""
    pool_k = torch.randn(n_rows, *k.shape[1:], generator=g).to(k.dtype)
    pool_k.view(torch.uint8)[slots] = k.view(torch.uint8)
    return pool_k


def case_snapkv_fp8_pool_fp16_queries(T):
    """fp8 keys read from the pool through slots next to fp16 queries: the kernel converts each key
    tile to fp16 as it loads it (exact), so the scores are those of the keys converted first."""
    g = torch.Generator().manual_seed(44)
    length, hkv, hq, d, w = 45, 2, 4, 32, 9
    k = (torch.randn(length, hkv, d, generator=g) * 2).to(torch.float8_e4m3fn)
    q_win = torch.randn(w, hq, d, generator=g).half()
    slots = torch.randperm(length + 20, generator=g)[:length]
    pool_k = _fp8_pool(length + 20, k, slots, g)
    want = R.snapkv_window_scores(q_win, k.half())
    torch.testing.assert_close(T.snapkv_window_scores(q_win, pool_k, slots=slots), want,
                               atol=1e-5, rtol=1e-3)
    # fp32 queries (the IEEE path converts 16-channel slices): the same scores as fp32 keys
    torch.testing.assert_close(T.snapkv_window_scores(q_win.float(), pool_k, slots=slots),
                               R.snapkv_window_scores(q_win.float(), k.float()), atol=1e-6, rtol=1e-4)
    for bad in (k.float(), pool_k.view(torch.uint8)):  # other keys than q's dtype or fp8: refused
        try:
            T.snapkv_window_scores(q_win, bad)
        except ValueError as exc:
            assert "dtype" in str(exc) and "q_win" in str(exc), str(exc)
        else:
            raise AssertionError(f"no refusal for {bad.dtype} keys next to fp16 queries")


def _compact_case(T, dtype, seed, shared_src):
    g = torch.Generator().manual_seed(seed)
    hkv, d, n = 3, 16, 150  # n > the kernel's block: several programs per head
    k, v = pool(400, hkv, d, dtype, g)
    k0, v0 = k.clone(), v.clone()
    if shared_src:
        src = torch.sort(torch.randperm(200, generator=g)[:n] + 20).values
    else:  # per-head positions, sorted: the real compaction pattern (moves towards the front)
        src = torch.stack([torch.sort(torch.randperm(200, generator=g)[:n] + 20).values
                           for _ in range(hkv)])
    dst = torch.arange(30, 30 + n)  # overlaps the sources
    kr, vr = k.clone(), v.clone()
    R.compact_kv(kr, vr, src, dst)
    T.compact_kv(k, v, src, dst)
    assert torch.equal(k, kr) and torch.equal(v, vr)
    src2 = src.expand(hkv, n)
    for h in range(hkv):
        assert torch.equal(k[dst, h], k0[src2[h], h]) and torch.equal(v[dst, h], v0[src2[h], h])


def case_compact_overlap_per_head_bf16(T):
    _compact_case(T, torch.bfloat16, 50, shared_src=False)


def case_compact_overlap_shared_fp32(T):
    _compact_case(T, torch.float32, 51, shared_src=True)


def case_compact_backward_overlap(T):
    """Rows moved towards the back over themselves: an in-place single pass would overwrite
    sources of later blocks (programs run in order under the interpreter) -- must not happen."""
    g = torch.Generator().manual_seed(53)
    k, v = pool(400, 2, 16, torch.float16, g)
    src = torch.arange(100, 250).expand(2, 150)
    dst = torch.stack([src[0] + 5, src[1] + 70])
    kr, vr = k.clone(), v.clone()
    R.compact_kv(kr, vr, src, dst)
    T.compact_kv(k, v, src, dst)
    assert torch.equal(k, kr) and torch.equal(v, vr)


def case_quest_scores_paged_physical_pages(T):
    """Summaries per physical page, reached through the slot table (pages scattered, partial
    last page, a request with one page); fp32 and bf16 summaries."""
    g = torch.Generator().manual_seed(61)
    page, hq, hkv, d, n_phys = 4, 4, 2, 16, 40
    r2t = torch.zeros(3, 30, dtype=torch.int32)
    order = (torch.randperm(n_phys - 1, generator=g) + 1).tolist()
    for b in range(3):
        for p in range(8):
            pg = order.pop()
            cols = r2t[b, p * page : (p + 1) * page]  # the last page is cut by the table width
            cols[:] = torch.arange(pg * page, (pg + 1) * page)[: cols.numel()]
    for dtype in (torch.float32, torch.bfloat16):
        kmin = torch.randn(n_phys, hkv, d, generator=g).to(dtype)
        kmax = kmin + torch.rand(n_phys, hkv, d, generator=g).to(dtype)
        q = torch.randn(3, hq, d, generator=g).to(dtype)
        rows, n_pages = torch.tensor([2, 0, 1]), torch.tensor([8, 1, 5])
        want = R.quest_page_scores_paged(q, kmin, kmax, r2t, rows, n_pages, page)
        got = T.quest_page_scores_paged(q, kmin, kmax, r2t, rows, n_pages, page, block_p=4)
        assert got.shape == (3, hq, 8)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def case_select_top_equals_the_stable_sort(T):
    """One program per row: the same indices as the reference's stable sort, ties to the lower
    index, -inf never taken (-1 padding at the end), negative and positive scores, rows longer
    than one power of two, k equal to the row."""
    g = torch.Generator().manual_seed(71)
    for rows, p, k in ((5, 37, 8), (3, 300, 30), (2, 16, 16), (4, 1030, 129)):
        s = torch.randn(rows, p, generator=g)
        s[0, ::3] = 0.25  # a block of ties
        s[1, p // 2:] = float("-inf")  # a short request: fewer finite pages than k on some rows
        s[-1] = s[-1].round()  # many ties around the threshold
        s[2 % rows, :] = -s[2 % rows, :].abs()  # all negative
        want = R.quest_select_pages(s.view(1, rows, p), k).long()[0]
        got = T.select_top(s, k)
        assert torch.equal(got, want), (p, k, got, want)
    s = torch.full((2, 3, 50), float("-inf"))
    s[1, 2, 7] = -5.0
    got = T.select_top(s, 4)
    assert got.shape == (2, 3, 4) and got[1, 2].tolist() == [7, -1, -1, -1] and (got[0] == -1).all()


def case_fold_decode_keys_equals_the_scatter(T):
    """Decode (one token per request, each in its own page): summaries equal the reference's,
    a page's first slot starts it afresh, continued pages keep their min/max; bf16 and fp32."""
    g = torch.Generator().manual_seed(72)
    page, hkv, d, n_pages = 4, 3, 24, 12
    for dt in (torch.float32, torch.bfloat16):
        kmin = torch.randn(n_pages, hkv, d, generator=g).to(dt)
        kmax = kmin + 1
        want_min, want_max = kmin.clone(), kmax.clone()
        slots = torch.tensor([9 * page, 3 * page + 2, 5 * page + 1, 7 * page + 3])  # fresh + continued
        k = torch.randn(4, hkv, d, generator=g).to(dt)
        R.quest_fold_keys(want_min, want_max, k, slots, page)
        T.quest_fold_decode_keys(kmin, kmax, k, slots, page)
        pages = slots // page  # page 0 (the padding page) is reset by the reference only
        assert torch.equal(kmin[pages], want_min[pages]) and torch.equal(kmax[pages], want_max[pages])
        rest = torch.ones(n_pages, dtype=torch.bool)
        rest[pages] = False
        rest[0] = False
        assert torch.equal(kmin[rest], want_min[rest]) and torch.equal(kmax[rest], want_max[rest])


def segment_wave(r, layers, hkv, d, n, budget, dtype, seed, per_layer):
    """A wave's moves as ``CacheManager.compact_rows_many`` builds them: ``r`` requests of ``n``
    rows at scattered slots of a flat pool (``layers`` parts of ``per_layer`` slots), each keeping
    ``budget`` ascending rows per (layer, head); entries in runs of ``budget`` per (request,
    layer), row order. Returns the pool (K, V) and the flat-cell ``src [Hkv, N]``, ``dst [N]``."""
    g = torch.Generator().manual_seed(seed)
    k, v = pool(layers * per_layer, hkv, d, dtype, g)
    slots = (torch.randperm(per_layer - 1, generator=g)[: r * n] + 1).view(r, n)
    rows = torch.rand(r, layers, hkv, n, generator=g).argsort(-1)[..., :budget].sort(-1).values
    rows[0, 0, 0] = torch.arange(budget)  # a run whose rows stay put: nothing read or written
    base = torch.arange(layers) * per_layer
    src = slots.gather(1, rows.flatten(1)).view(rows.shape) + base.view(1, layers, 1, 1)
    dst = slots[:, :budget].view(r, 1, budget) + base.view(1, layers, 1)
    return k, v, src.permute(2, 0, 1, 3).reshape(hkv, -1), dst.reshape(-1)


def case_compact_segments_in_place_equal_the_reference(T):
    """``compact_kv(segment=B)``: one in-place pass per (run, head), no temporary; several tiles
    per run (``block_n`` 16 over runs of 37), runs sharing no slot, one that does not move."""
    for dtype, hkv, d, per_layer in ((torch.float32, 2, 16, 300), (torch.bfloat16, 3, 24, 260)):
        k, v, src, dst = segment_wave(3, 2, hkv, d, 70, 37, dtype, seed=hkv, per_layer=per_layer)
        kr, vr = k.clone(), v.clone()
        R.compact_kv(kr, vr, src, dst)
        for block_n in (16, None):
            k2, v2 = k.clone(), v.clone()
            T.compact_kv(k2, v2, src, dst, segment=37, block_n=block_n)
            assert torch.equal(k2, kr) and torch.equal(v2, vr), (dtype, block_n)
    try:
        T.compact_kv(k.clone(), v.clone(), src, dst, segment=36)
    except ValueError as exc:
        assert "segment=36 must divide" in str(exc), str(exc)
    else:
        raise AssertionError("a segment that does not divide the entries was not refused")


def case_compact_disjoint_fast_path(T):
    g = torch.Generator().manual_seed(52)
    k, v = pool(100, 2, 16, torch.float16, g)
    src = torch.tensor([[50, 61, 70], [55, 56, 90]])
    dst = torch.tensor([1, 2, 3])
    kr, vr = k.clone(), v.clone()
    R.compact_kv(kr, vr, src, dst)
    T.compact_kv(k, v, src, dst, assume_disjoint=True)
    assert torch.equal(k, kr) and torch.equal(v, vr)


def cells_inputs(hq, hkv, d, layers, dtype, seed, packed, tails, ctx=64, slots=160):
    """A per-layer packed layout (PyramidKV's): request b on row ``2 b + 1`` owns its first
    ``packed[b]`` slots (K) and ``tails[b]`` more; layer l keeps ``B_l`` rows (sum <= K * layers)
    in distinct cells of its own K slots, and the packed list is stored at the request's own
    cells (entry e at ``(e // K) * slots + slot[e % K]``). Returns the kernel arguments and, per
    (request, layer), the cells a decode must read, written out from the definition."""
    g = torch.Generator().manual_seed(seed)
    b = len(packed)
    flat_k = torch.randn(layers * slots, hkv, d, generator=g).to(dtype)
    flat_v = torch.randn(layers * slots, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    rows = 2 * b + 2
    r2t = torch.zeros(rows, ctx, dtype=torch.int32)
    entries = torch.full((layers * slots,), -1, dtype=torch.int32)
    offset = torch.zeros(rows, layers, dtype=torch.int32)
    count = torch.zeros(rows, layers, dtype=torch.int32)
    packed_rows = torch.zeros(rows, dtype=torch.int32)
    free = torch.randperm(slots, generator=g)
    want, used = {}, 0
    for i, (kp, tail) in enumerate(zip(packed, tails)):
        row = 2 * i + 1
        mine = free[used: used + kp + tail]
        used += kp + tail
        r2t[row, : kp + tail] = mine.to(torch.int32)
        own = torch.stack([layer * slots + mine[:kp] for layer in range(layers)]).flatten()
        own = own[torch.randperm(own.numel(), generator=g)]  # rows anywhere in the own cells
        total = int(torch.randint(kp * layers // 2, kp * layers + 1, (1,), generator=g)) if kp else 0
        cuts = sorted(torch.randint(0, total + 1, (layers - 1,), generator=g).tolist())
        budgets = torch.tensor([b - a for a, b in zip([0, *cuts], [*cuts, total])])  # uneven, sum <= K * layers
        lists, at = [], 0
        for layer in range(layers):
            lists.append(own[at: at + int(budgets[layer])])
            at += int(budgets[layer])
        flat = torch.cat(lists)
        e = torch.arange(flat.numel())
        if kp:
            entries[(e // kp) * slots + mine[:kp][e % kp]] = flat.to(torch.int32)
        count[row] = budgets.to(torch.int32)
        offset[row] = (torch.cumsum(budgets, 0) - budgets).to(torch.int32)
        packed_rows[row] = kp
        for layer in range(layers):
            want[i, layer] = torch.cat([lists[layer], layer * slots + mine[kp:]])
    req_rows = torch.arange(1, 2 * b + 1, 2)
    seq_lens = torch.tensor([kp + t for kp, t in zip(packed, tails)], dtype=torch.int32)
    return (q, flat_k, flat_v, r2t, req_rows, seq_lens, entries, offset, count, packed_rows, slots), want


def _cells_case(T, dtype, hq, hkv, d, seed, packed=(5, 0, 9), tails=(3, 7, 1)):
    args, want_cells = cells_inputs(hq, hkv, d, 3, dtype, seed, list(packed), list(tails))
    q, flat_k, flat_v, r2t, req_rows, seq_lens, entries, offset, count, packed_rows, slots = args
    for layer in range(3):
        cells, valid = R.cell_table_cells(r2t, req_rows, seq_lens, entries, offset, count, packed_rows,
                                          layer, slots)
        for i in range(len(packed)):  # the reference's index chain equals the layout's definition
            n = int(valid[i].sum())
            assert bool(valid[i, :n].all()) and torch.equal(cells[i, :n], want_cells[i, layer])
        want = R.cells_decode_attention(q, flat_k, flat_v, r2t, req_rows, seq_lens, entries, offset, count,
                                        packed_rows, layer, slots)
        for splits in (1, 3):
            got = T.cells_decode_attention(q, flat_k, flat_v, r2t, req_rows, seq_lens, entries, offset, count,
                                           packed_rows, layer, slots, num_splits=splits, block_n=4)
            close(got, want, dtype, f"layer {layer} splits={splits}")


def case_cells_fp32_gqa2(T):
    _cells_case(T, torch.float32, 4, 2, 32, 60)


def case_cells_bf16_mha_d48_empty_request(T):
    _cells_case(T, torch.bfloat16, 2, 2, 48, 61, packed=(0, 4), tails=(0, 2))  # request 0 reads nothing


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    """Subprocess side: run every case under the interpreter, report each outcome."""
    from sgl_kernel_sparse import triton_ops as T

    return run_cases(CASES, T)


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_kernels_compile_for_sm90_without_spills(tmp_path):
    """fp16 + fp32 (fp32 SnapKV takes its own exact-dot path); the full matrix:
    ``python sgl-kernel-sparse/bench/compile_report.py``."""
    report = tmp_path / "report.json"
    res = subprocess.run(
        [sys.executable, str(PKG_ROOT / "bench" / "compile_report.py"), "--dtypes", "fp16,fp32",
         "--json", str(report)], capture_output=True, text=True, timeout=300)
    if res.returncode == 3:
        pytest.skip(res.stderr.strip())
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    kernels = {r["kernel"] for r in json.loads(report.read_text())}
    assert kernels == {"_decode_partial_kernel", "_decode_reduce_kernel", "_rows_tail_partial_kernel",
                       "_token_logits_kernel",
                       "_quest_scores_kernel", "_fold_decode_keys_kernel", "_select_top_kernel",
                       "_select_top_radix_kernel", "_select_top_nibble_kernel", "_paged_gqa_partial_kernel",
                       "_snapkv_lse_kernel", "_snapkv_score_kernel",
                       "_copy_rows_kernel", "_compact_segments_kernel"}


# ============================================================ GPU: compiled kernels, real shapes

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d,n", [(32, 8, 128, 1000), (28, 4, 128, 4099), (16, 16, 64, 77)])
def test_gpu_sparse_decode(dtype, hq, hkv, d, n):
    from sgl_kernel_sparse import triton_ops as T

    cpu = decode_inputs(6, hq, hkv, d, n, 8192, dtype, 100 + n)
    q, k, v, r2t, req_rows, rows, valid = (t.cuda() for t in cpu)
    want = R.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid)
    for splits in (None, 1, 7):
        got = T.sparse_decode_attention(q, k, v, r2t, req_rows, rows, valid, num_splits=splits)
        close(got, want, dtype, f"splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_cells_decode(dtype):
    """PyramidKV's decode kernel at a real shape: 1,000-3,000 packed rows, long and empty tails."""
    from sgl_kernel_sparse import triton_ops as T

    cpu, _ = cells_inputs(32, 8, 128, 4, dtype, 400, [1000, 3000, 0, 50], [10, 900, 5, 0], ctx=4096, slots=8000)
    args = [t.cuda() if isinstance(t, torch.Tensor) else t for t in cpu]
    for layer in range(4):
        want = R.cells_decode_attention(*args[:10], layer, args[10])
        for splits in (None, 1, 5):
            got = T.cells_decode_attention(*args[:10], layer, args[10], num_splits=splits)
            close(got, want, dtype, f"layer {layer} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page", [16, 64])
def test_gpu_paged_decode(dtype, page):
    from sgl_kernel_sparse import triton_ops as T

    seq_lens = [32000 + 5, 8000, 17 * page - 3, 4000 + page // 2]
    cpu = paged_inputs(4, 32, 8, 128, page, 2048 // page, dtype, 200 + page, seq_lens)
    q, k, v, r2t, req_rows, page_ids, seq = (t.cuda() for t in cpu)
    want = R.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
    for splits in (None, 1):
        got = T.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page,
                                              num_splits=splits)
        close(got, want, dtype, f"splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_paged_decode_launch_variants(dtype):
    """Quest's served call (aligned 16-slot pages) under every option tune_quest_kernels.py
    sweeps: prefetched page ids, Triton loop pipelining, block sizes, warps, split-K."""
    from sgl_kernel_sparse import triton_ops as T

    page, seq_lens = 16, [32000 + 5, 8000, 17 * 16 - 3, 4000 + 8]
    q, _, _, _, _, page_ids, seq = paged_inputs(4, 32, 8, 128, page, 128, dtype, 260, seq_lens)
    g = torch.Generator().manual_seed(261)
    r2t = _aligned_table(5, (max(seq_lens) // page + 2) * page, page, g)
    k = torch.randn(int(r2t.max()) + page, 8, 128, generator=g).to(dtype)
    q, k, v, r2t, page_ids, seq = (t.cuda() for t in (q, k, torch.randn_like(k), r2t, page_ids, seq))
    req_rows = torch.tensor([3, 0, 4, 1], device="cuda")
    want = R.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
    for prefetch, stages in ((False, 0), (True, 0), (False, 2), (False, 3)):
        for splits, block_n, warps in ((None, None, None), (1, 64, 8), (16, 16, 4), (64, 32, 8)):
            got = T.paged_sparse_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page, aligned=True,
                                                  prefetch=prefetch, num_stages=stages, num_splits=splits,
                                                  block_n=block_n, num_warps=warps)
            close(got, want, dtype, f"prefetch={prefetch} stages={stages} splits={splits} block_n={block_n}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gpu_paged_gqa_decode(dtype):
    """The GQA kernel of ``--sparse-select-per kv_head`` compiled, at the 8B shape (128 pages of
    16 per KV head), at each option tune_quest_kernels.py sweeps: the expanded reference."""
    from sgl_kernel_sparse import triton_ops as T

    page, seq_lens = 16, [32000 + 5, 8000, 17 * 16 - 3, 4000 + 8]
    _, _, _, _, _, page_ids, seq = paged_inputs(4, 8, 8, 128, page, 128, dtype, 263, seq_lens)
    g = torch.Generator().manual_seed(264)
    r2t = _aligned_table(5, (max(seq_lens) // page + 2) * page, page, g)
    k = torch.randn(int(r2t.max()) + page, 8, 128, generator=g).to(dtype)
    q = torch.randn(4, 32, 128, generator=g).to(dtype)
    q, k, v, r2t, page_ids, seq = (t.cuda() for t in (q, k, torch.randn_like(k), r2t, page_ids, seq))
    req_rows = torch.tensor([3, 0, 4, 1], device="cuda")
    want = R.paged_gqa_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page)
    for aligned in (False, True):
        for splits, block_n, warps, stages, pre in ((None, None, None, None, None), (1, 64, 8, 2, None),
                                                    (16, 16, 4, 4, False), (32, 32, 8, None, False),
                                                    (16, 64, 4, None, True), (3, 32, 2, None, True)):
            got = T.paged_gqa_decode_attention(q, k, v, r2t, req_rows, page_ids, seq, page, aligned=aligned,
                                               num_splits=splits, block_n=block_n, num_warps=warps,
                                               num_stages=stages, prefetch=pre)
            close(got, want, dtype, f"aligned={aligned} splits={splits} block_n={block_n} stages={stages} "
                  f"prefetch={pre}")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["bits", "radix", "nibble"])
def test_gpu_select_top_methods(method):
    """The three selection kernels at Quest's 128K shape (8,192 pages, 128 kept) and with ties,
    compiled: the stable sort's indices, at each warp count and chunk tune_quest_kernels.py tries."""
    from sgl_kernel_sparse import triton_ops as T

    g = torch.Generator().manual_seed(262)
    s = torch.randn(4 * 32, 8192, generator=g)
    s[1] = s[1].to(torch.bfloat16).float()
    s[2, 4000:] = float("-inf")
    s[3] = torch.randint(-3, 3, (8192,), generator=g).float()
    want = R.quest_select_pages(s.view(4, 32, -1), 128).long().cuda()
    for warps, chunk in ((None, None), (4, 1024), (8, 1024), (16, 4096), (32, 1024)):
        got = T.select_top(s.view(4, 32, -1).cuda(), 128, method=method, num_warps=warps, chunk=chunk)
        assert torch.equal(got, want), (warps, chunk)
    ragged = torch.randn(8, 8200, generator=g)  # 8,200 pages (131,200-token context): no slice size divides it
    ragged[1] = ragged[1].to(torch.bfloat16).float()  # ties
    want = R.quest_select_pages(ragged.reshape(1, 8, -1), 128).long()[0].cuda()
    for warps in (None, 4, 16, 32):
        assert torch.equal(T.select_top(ragged.cuda(), 128, method=method, num_warps=warps), want), warps


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_omnikv_kernels(dtype):
    """OmniKV at a real shape: 2,048 chosen rows plus tails of 0-900 rows; logits over a
    33K-wide slot table."""
    from sgl_kernel_sparse import triton_ops as T

    cpu = rows_tail_inputs(4, 32, 8, 128, 2048, 33000, dtype, 500, (900, 0, 1, 300))
    q, k, v, r2t, req_rows, sel, t0, seq = (t.cuda() for t in cpu)
    want = R.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq)
    for splits in (None, 1, 9):
        got = T.rows_tail_decode_attention(q, k, v, r2t, req_rows, sel, t0, seq, num_splits=splits)
        close(got, want, dtype, f"splits={splits}")
    got = T.token_logits(q, k, r2t, req_rows, seq)
    torch.testing.assert_close(got, R.token_logits(q, k, r2t, req_rows, seq), atol=2e-3, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_quest_scores(dtype):
    from sgl_kernel_sparse import triton_ops as T

    g = torch.Generator().manual_seed(300)
    hq, hkv, d, p_max = 32, 8, 128, 263
    kmin = torch.randn(4, p_max, hkv, d, generator=g)
    kmax = (kmin + torch.rand(4, p_max, hkv, d, generator=g)).cuda()
    kmin = kmin.cuda()
    q = torch.randn(4, hq, d, generator=g).to(dtype).cuda()
    n_pages = torch.tensor([p_max, 200, 1, 263], device="cuda")
    rows = torch.tensor([0, 2, 3, 0], device="cuda")
    s_got = T.quest_page_scores(q, kmin, kmax, n_pages, summary_rows=rows)
    s_want = R.quest_page_scores(q, kmin, kmax, n_pages, summary_rows=rows)
    torch.testing.assert_close(s_got, s_want, atol=1e-3, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("length,w", [(4096 + 17, 32), (1000, 64), (33, 33)])
def test_gpu_snapkv_scores(dtype, length, w):
    from sgl_kernel_sparse import triton_ops as T

    g = torch.Generator().manual_seed(length + w)
    k = torch.randn(length, 8, 128, generator=g).to(dtype).cuda()
    q_win = torch.randn(w, 32, 128, generator=g).to(dtype).cuda()
    want = R.snapkv_window_scores(q_win, k)
    got = T.snapkv_window_scores(q_win, k)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=2e-3)
    assert torch.allclose(got.sum(dim=1), torch.full((8,), float(w), device="cuda"), rtol=1e-3)
    slots = torch.randperm(3 * length, generator=g)[:length].cuda()
    pool_k = torch.zeros(3 * length, 8, 128, dtype=dtype, device="cuda")
    pool_k[slots] = k
    torch.testing.assert_close(T.snapkv_window_scores(q_win, pool_k, slots=slots), got,
                               atol=1e-6, rtol=1e-5)
    if dtype == torch.float32:  # exact-ish scores: the selection itself must agree
        budget = min(length, 1024)
        assert torch.equal(R.snapkv_select(got, w, budget, 7), R.snapkv_select(want, w, budget, 7))


def test_fp8_keys_are_converted_in_torch_where_triton_cannot(monkeypatch):
    """Before sm_89 Triton has no in-kernel fp8 conversion: ``kernel_keys`` gathers the keys through
    the slots and converts them in torch (checked here with the capability test forced off)."""
    from sgl_kernel_sparse import triton_common as C

    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 16, generator=g).to(torch.bfloat16)
    pool_k = torch.randn(30, 1, 16, generator=g).to(torch.float8_e4m3fn)
    slots = torch.tensor([7, 2, 19])
    keys, s = C.kernel_keys(q, pool_k, "q", "k", slots)
    assert keys is pool_k and s is slots  # the interpreter / sm_89+: converted in the kernel
    monkeypatch.setattr(C, "fp8_in_kernel", lambda device: False)
    keys, s = C.kernel_keys(q, pool_k, "q", "k", slots)
    assert s is None and keys.dtype == torch.bfloat16
    assert torch.equal(keys, pool_k[slots].to(torch.bfloat16))
    with pytest.raises(ValueError, match="q torch.bfloat16 and k torch.float16 must share a dtype"):
        C.kernel_keys(q, pool_k.half(), "q", "k")


@pytest.mark.gpu
def test_gpu_snapkv_scores_fp8_pool():
    """SnapKV with ``--kv-cache-dtype fp8_e4m3``: bf16 window queries, fp8 keys read from the pool
    through slots, converted inside the kernel (its tensor-core path, which the interpreter case
    does not take for bf16)."""
    from sgl_kernel_sparse import triton_ops as T

    g = torch.Generator().manual_seed(7)
    length, w = 4096 + 17, 32
    k = (torch.randn(length, 8, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    q_win = torch.randn(w, 32, 128, generator=g).to(torch.bfloat16)
    slots = torch.randperm(2 * length, generator=g)[:length]
    pool_k = _fp8_pool(2 * length, k, slots, g)
    want = R.snapkv_window_scores(q_win, k.to(torch.bfloat16))
    got = T.snapkv_window_scores(q_win.cuda(), pool_k.cuda(), slots=slots.cuda())
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_compact_kv(dtype):
    from sgl_kernel_sparse import triton_ops as T

    g = torch.Generator().manual_seed(400)
    hkv, d, n = 8, 128, 3000
    k, v = (t.cuda() for t in pool(20000, hkv, d, dtype, g))
    src = torch.stack([torch.sort(torch.randperm(9000, generator=g)[:n] + 100).values
                       for _ in range(hkv)]).cuda()
    dst = torch.arange(100, 100 + n, device="cuda")
    kr, vr = k.clone(), v.clone()
    R.compact_kv(kr, vr, src, dst)
    T.compact_kv(k, v, src, dst)
    assert torch.equal(k, kr) and torch.equal(v, vr)


@pytest.mark.gpu
def test_gpu_compact_kv_segments():
    """A wave batch's moves at R-KV's capacity shape (15 requests x 36 layers, 2,176 rows kept to
    2,048, 8 KV heads, d 128, bf16) in one in-place launch equal the reference; timed next to the
    two-launch move through a temporary (printed, not asserted)."""
    from sgl_kernel_sparse import triton_ops as T

    k, v, src, dst = segment_wave(15, 36, 8, 128, 2176, 2048, torch.bfloat16, seed=401, per_layer=33000)
    k, v, src, dst = k.cuda(), v.cuda(), src.cuda(), dst.cuda()
    kr, vr = k.clone(), v.clone()
    R.compact_kv(kr, vr, src, dst)
    got_k, got_v = k.clone(), v.clone()
    T.compact_kv(got_k, got_v, src, dst, segment=2048)
    assert torch.equal(got_k, kr) and torch.equal(got_v, vr)
    times = {}
    for name, kw in (("two launches", {}), ("segments", {"segment": 2048})):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            T.compact_kv(k, v, src, dst, **kw)  # the same moves again: times only
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 3
    print(f"compact_kv, a wave batch of 15 x 36 layers x 2,048 rows: {times}")


@pytest.mark.gpu
def test_gpu_dispatch_picks_triton():
    import sgl_kernel_sparse as sks

    q = torch.zeros(1, device="cuda")
    assert sks.use_triton(q)


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
