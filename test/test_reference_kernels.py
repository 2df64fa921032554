"""The plain-torch references (``sgl_kernel_sparse.reference``, the one definition of each formula)
against independent, loop-based readings of the formulas in shared/notes/methods.md (SnapKV,
Quest). Small random tensors, CPU, milliseconds."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kernel_sparse import reference as ref

import single_request as one


def loop_snapkv(q_win, k, budget, window, kernel):
    """SnapKV by the definition, one KV head and one candidate at a time, python floats."""
    length, hkv, d = k.shape
    hq = q_win.shape[1]
    group = hq // hkv
    if length <= budget:
        return [list(range(length)) for _ in range(hkv)]
    w = window
    out = []
    for g in range(hkv):
        raw = []
        for j in range(length - w):
            total = 0.0
            for h in range(g * group, (g + 1) * group):
                for t in range(w):
                    i = length - w + t  # logical position of this window query
                    logits = [float(q_win[t, h] @ k[jj, g]) / math.sqrt(d) for jj in range(i + 1)]
                    m = max(logits)
                    z = sum(math.exp(x - m) for x in logits)
                    total += math.exp(logits[j] - m) / z
            raw.append(total / group)
        pad = kernel // 2
        pooled = [
            sum(raw[x] for x in range(j - pad, j + pad + 1) if 0 <= x < len(raw)) / kernel
            for j in range(len(raw))
        ]
        order = sorted(range(len(pooled)), key=lambda j: (-pooled[j], j))
        out.append(sorted(order[: budget - w]) + list(range(length - w, length)))
    return out


@pytest.mark.parametrize("length,budget,window,kernel,hq,hkv", [
    (40, 16, 4, 5, 6, 2),   # GQA 3:1, pooling
    (33, 12, 4, 1, 4, 4),   # MHA, no pooling
    (20, 20, 4, 5, 2, 1),   # budget == length: identity
    (10, 16, 4, 7, 2, 2),   # budget > length: identity
])
def test_snapkv_matches_definition(length, budget, window, kernel, hq, hkv):
    g = torch.Generator().manual_seed(length * 7 + budget)
    k = torch.randn(length, hkv, 8, generator=g)
    q_win = torch.randn(window, hq, 8, generator=g)
    got = ref.snapkv_keep_indices(q_win, k, budget, window, kernel)
    assert got.tolist() == loop_snapkv(q_win, k, budget, window, kernel)


def test_snapkv_ties_go_to_lower_index_and_window_is_kept():
    # All keys equal: every candidate has the same score; the lowest indices must win.
    k = torch.ones(30, 1, 4)
    q_win = torch.ones(4, 2, 4)
    got = ref.snapkv_keep_indices(q_win, k, budget=10, window=4, kernel=1)
    assert got.tolist() == [[0, 1, 2, 3, 4, 5, 26, 27, 28, 29]]


def loop_quest(q, k, page_size, budget):
    length, hkv, d = k.shape
    hq = q.shape[0]
    group = hq // hkv
    n_pages = -(-length // page_size)
    n_sel = min(max(3, budget // page_size), n_pages)
    out = []
    for h in range(hq):
        scores = []
        for p in range(n_pages):
            toks = range(p * page_size, min((p + 1) * page_size, length))
            s = 0.0
            for c in range(d):
                mn = min(float(k[t, h // group, c]) for t in toks)
                mx = max(float(k[t, h // group, c]) for t in toks)
                s += max(float(q[h, c]) * mx, float(q[h, c]) * mn)
            scores.append(s)
        order = sorted(range(n_pages), key=lambda p: (-scores[p], p))
        out.append(sorted(order[:n_sel]))
    return out


@pytest.mark.parametrize("length,page,budget", [(64, 16, 32), (70, 16, 48), (5, 16, 64), (100, 8, 8)])
def test_quest_selection_matches_definition(length, page, budget):
    g = torch.Generator().manual_seed(length + page)
    k = torch.randn(length, 2, 8, generator=g)
    q = torch.randn(6, 8, generator=g)
    kmin, kmax = ref.quest_page_summaries(k, page)
    got = one.quest_select_pages(q, kmin, kmax, budget, page)
    assert got.tolist() == loop_quest(q, k, page, budget)


def test_quest_partial_last_page_summary_covers_only_valid_tokens():
    k = torch.arange(20, dtype=torch.float32).view(20, 1, 1)
    kmin, kmax = ref.quest_page_summaries(k, 16)
    assert kmin.flatten().tolist() == [0.0, 16.0]
    assert kmax.flatten().tolist() == [15.0, 19.0]


def test_sparse_decode_attention_equals_dense_attention_on_the_subset():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 8, generator=g)
    q = torch.randn(4, 8, generator=g)
    keep = [0, 3, 4, 11]
    mask = torch.zeros(4, 12, dtype=torch.bool)
    mask[:, keep] = True
    got = one.masked_decode_attention(q, k, v, mask)
    for h in range(4):
        kv = h // 2
        w = torch.softmax(k[keep, kv] @ q[h] / math.sqrt(8), dim=0)
        torch.testing.assert_close(got[h], w @ v[keep, kv])


def _views_batch(device="cpu", seed=0):
    """Three requests of one layer: different lengths and per-head row counts, padding marked
    invalid (and holding rows past the request's end, which must never be read)."""
    g = torch.Generator().manual_seed(seed)
    hq, hkv, d, slots = 6, 2, 16, 400
    k_cache, v_cache = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    req_to_token = torch.randperm(slots, generator=g)[:3 * 120].view(3, 120).to(torch.int32)
    lengths, rows, valid = [50, 7, 120], [], []
    for n_rows in lengths:
        n = min(n_rows, 20)
        r = torch.stack([torch.sort(torch.randperm(n_rows, generator=g)[:n]).values for _ in range(hq)])
        m = torch.ones(hq, n, dtype=torch.bool)
        m[1, n // 2:] = False  # one head reads fewer rows
        r[1, n // 2:] = n_rows + 5  # past the end: must be clamped, never read
        rows.append(r)
        valid.append(m)
    q = torch.randn(3, hq, d, generator=g)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(req_to_token), [0, 1, 2], [to(r) for r in rows],
            [to(v) for v in valid], lengths, d ** -0.5)


def test_decode_over_views_equals_the_kernel_package_on_a_padded_batch():
    """The per-request reference loop (CPU path) and sgl_kernel_sparse's batched API (the CUDA
    path; its own reference on CPU) agree on a ragged batch."""
    import sgl_kernel_sparse

    from sglang_sparse.kernels.decode import decode_over_views, pad_views

    q, kc, vc, r2t, req_rows, rows, valid, lengths, scale = _views_batch()
    loop = decode_over_views(q, kc, vc, r2t, req_rows, rows, valid, lengths, scale)
    r, v = pad_views(rows, valid, lengths)
    batched = sgl_kernel_sparse.sparse_decode_attention(q, kc, vc, r2t, torch.tensor(req_rows), r, v, scale)
    torch.testing.assert_close(batched, loop, rtol=1e-5, atol=1e-5)
    # and both equal attention over the selected logical tokens, head by head
    for i in range(3):
        slots = r2t[i, : lengths[i]].long()
        for h in range(q.shape[1]):
            sel = slots[rows[i][h][valid[i][h]]]
            kh = kc[sel, h // 3]
            w = torch.softmax((kh @ q[i, h]) * scale, dim=0)
            torch.testing.assert_close(loop[i, h], w @ vc[sel, h // 3], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_decode_over_views_uses_triton_on_cuda_and_matches_the_cpu_path():
    import sgl_kernel_sparse
    from sglang_sparse.kernels import decode

    cpu = _views_batch()
    gpu = _views_batch("cuda")
    assert sgl_kernel_sparse.use_triton(*gpu[:4])
    want = decode.decode_over_views(*cpu)
    got = decode.decode_over_views(*gpu).cpu()
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
