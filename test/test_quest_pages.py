"""Quest's per-physical-page summaries and batched selection (``kernels.quest_pages``): equal to
the loop-by-loop reference on a ragged batch whose pages are scattered and recycled, and
replayable from a captured CUDA graph with new inputs (GPU only)."""

from __future__ import annotations

import pytest
import torch

from sgl_kernel_sparse import reference

import single_request as one
from sglang_sparse.kernels import quest_pages
from sglang_sparse.kernels.decode import decode_over_pages

PAGE, HQ, HKV, D = 4, 6, 2, 8


def paged_batch(lengths, seed, device="cpu", dtype=torch.float32):
    """Requests of ``lengths`` tokens whose pages are scattered over the pool (never page 0)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = 64
    k_cache = torch.randn(n_pages * PAGE, HKV, D, generator=g).to(device, dtype)
    v_cache = torch.randn(n_pages * PAGE, HKV, D, generator=g).to(device, dtype)
    order = (torch.randperm(n_pages - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(lengths), 64, dtype=torch.int32)
    for i, n in enumerate(lengths):
        for p in range(-(-n // PAGE)):
            page = order.pop()
            table[i, p * PAGE : (p + 1) * PAGE] = torch.arange(page * PAGE, (page + 1) * PAGE)
    return k_cache, v_cache, table.to(device)


def test_summaries_scores_and_selection_match_the_reference_after_page_reuse():
    lengths = [13, 30, 4]
    k_cache, v_cache, table = paged_batch(lengths, seed=0)
    kmin, kmax = quest_pages.new_summaries(k_cache.shape[0], PAGE, HKV, D, torch.float32, "cpu")
    kmin.uniform_(-9, 9)  # stale summaries of released requests must not survive
    kmax.uniform_(-9, 9)
    for i, n in enumerate(lengths):  # prefill in two chunks, as the engine writes
        for lo, hi in ((0, n // 2 + 1), (n // 2 + 1, n)):
            slots = table[i, lo:hi].long()
            quest_pages.add_keys(kmin, kmax, k_cache[slots], slots, PAGE)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(1))
    rows, n_rows = torch.arange(len(lengths)), torch.tensor(lengths)
    scores = quest_pages.page_scores(q, kmin, kmax, table, rows, n_rows, PAGE)
    picked = quest_pages.top_pages(scores, 3)
    for i, n in enumerate(lengths):
        keys = k_cache[table[i, :n].long()]
        ref_min, ref_max = reference.quest_page_summaries(keys, PAGE)
        n_pages = -(-n // PAGE)
        torch.testing.assert_close(scores[i, :, :n_pages], one.quest_page_scores(q[i], ref_min, ref_max))
        assert torch.isinf(scores[i, :, n_pages:]).all()
        want = one.quest_select_pages(q[i], ref_min, ref_max, 3 * PAGE, PAGE)
        got = picked[i].sort(dim=-1).values
        assert torch.equal(got[:, -want.shape[1]:], want.long()) and (got[:, : 3 - want.shape[1]] == -1).all()
        # attention over the picked pages == reference attention over exactly those tokens
        mask = torch.zeros(HQ, n, dtype=torch.bool)
        for h in range(HQ):
            pos = (want[h].view(-1, 1) * PAGE + torch.arange(PAGE)).flatten()
            mask[h, pos[pos < n]] = True
        expected = one.masked_decode_attention(q[i], keys, v_cache[table[i, :n].long()], mask)
        out = decode_over_pages(q[i : i + 1], k_cache, v_cache, table, rows[i : i + 1], picked[i : i + 1],
                                n_rows[i : i + 1], PAGE, 1 / D ** 0.5)
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)


def test_kv_head_selection_is_one_page_set_per_group_from_the_summed_bounds():
    """``--sparse-select-per kv_head`` through QuestRuntime's graph-safe decode: each KV head's
    pages are the top pages of the sum of its query heads' bounds (a plain-torch reference from
    the keys themselves, stable sort: ties to the lower page), and decode over the view equals
    attention of every query head of the group over exactly those pages; ``head`` keeps each
    query head's own top pages, and here the two differ."""
    from sglang_sparse.core.events import DecodeBatch
    from sglang_sparse.methods.quest import QuestConfig, QuestRuntime

    lengths, group, n_sel = [13, 30, 9], HQ // HKV, 3
    k_cache, v_cache, table = paged_batch(lengths, seed=3)
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(4))
    rows, n_rows = torch.arange(len(lengths)), torch.tensor(lengths)
    slot = table[rows, n_rows - 1].long()
    views = {}
    for mode in ("head", "kv_head"):
        rt = QuestRuntime(None, QuestConfig(page_size=PAGE, token_budget=n_sel * PAGE, dense_layers=0,
                                            select_per=mode))
        kmin, kmax = rt._pages(0, k_cache)
        for i, n in enumerate(lengths):  # the prompt (all but the decoded token) as prefill wrote it
            slots = table[i, : n - 1].long()
            quest_pages.add_keys(kmin, kmax, k_cache[slots], slots, PAGE)
        views[mode] = rt.decode_view_tensors(DecodeBatch(0, q, k_cache[slot], rows, n_rows, slot, table,
                                                         k_cache, v_cache))
    kv = views["kv_head"]
    assert kv.per_kv_head and not views["head"].per_kv_head
    assert kv.page_ids.shape == (len(lengths), HKV, n_sel) and views["head"].page_ids.shape == (len(lengths), HQ, n_sel)
    out = decode_over_pages(q, k_cache, v_cache, table, rows, kv.page_ids, n_rows, PAGE, 1 / D ** 0.5,
                            aligned=kv.aligned, per_kv_head=True)
    for i, n in enumerate(lengths):
        keys = k_cache[table[i, :n].long()]
        ref_min, ref_max = reference.quest_page_summaries(keys, PAGE)
        bounds = one.quest_page_scores(q[i], ref_min, ref_max)  # [HQ, pages]
        summed = bounds.view(HKV, group, -1).sum(1)
        k = min(n_sel, summed.shape[1])
        want = torch.sort(summed, dim=-1, descending=True, stable=True).indices[:, :k].sort(-1).values
        got = kv.page_ids[i]
        mask = torch.zeros(HQ, n, dtype=torch.bool)
        for g in range(HKV):
            assert torch.equal(got[g, :k].long(), want[g]), (i, g)
            assert (got[g, k:] == -1).all()
            pos = (want[g].view(-1, 1) * PAGE + torch.arange(PAGE)).flatten()
            mask[g * group : (g + 1) * group, pos[pos < n]] = True
        expected = one.masked_decode_attention(q[i], keys, v_cache[table[i, :n].long()], mask)
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-5)
    head_sets = views["head"].page_ids.view(len(lengths), HKV, group, n_sel)
    assert not all(torch.equal(head_sets[:, :, j], kv.page_ids) for j in range(group))


def test_select_per_is_validated_with_a_sentence():
    from sglang_sparse.methods.quest import QuestConfig
    from sglang_sparse.registry import ConfigError

    with pytest.raises(ConfigError, match="select_per='query' is not allowed: must be head .* or kv_head"):
        QuestConfig(select_per="query").validate()


@pytest.mark.gpu
@pytest.mark.parametrize("per_kv_head", [False, True])
def test_decode_selection_and_attention_replay_from_a_cuda_graph(per_kv_head):
    """Capture summary update + scoring + top pages + the paged kernel once; replaying with new
    queries, keys and lengths copied into the same buffers equals running them eagerly (also
    with one page set per KV head and the GQA kernel, ``--sparse-select-per kv_head``)."""
    dev = "cuda"
    lengths = [40, 17, 29]
    k_cache, v_cache, table = paged_batch(lengths, seed=2, device=dev, dtype=torch.bfloat16)
    kmin, kmax = quest_pages.new_summaries(k_cache.shape[0], PAGE, HKV, D, torch.bfloat16, dev)
    for i, n in enumerate(lengths):
        slots = table[i, : n - 2].long()
        quest_pages.add_keys(kmin, kmax, k_cache[slots], slots, PAGE)
    rows = torch.arange(3, device=dev)
    q_buf = torch.zeros(3, HQ, D, device=dev, dtype=torch.bfloat16)
    n_buf = torch.zeros(3, dtype=torch.int64, device=dev)
    slot_buf = torch.zeros(3, dtype=torch.int64, device=dev)

    def step():
        kk = k_cache[slot_buf]
        quest_pages.add_decode_keys(kmin, kmax, kk, slot_buf, PAGE)  # the server's decode path
        scores = quest_pages.page_scores(q_buf, kmin, kmax, table, rows, n_buf, PAGE)
        if per_kv_head:
            scores = quest_pages.group_scores(scores, HQ // HKV)
        pages = quest_pages.top_pages(scores, 3)
        return decode_over_pages(q_buf, k_cache, v_cache, table, rows, pages, n_buf, PAGE, 1 / D ** 0.5,
                                 aligned=True, per_kv_head=per_kv_head)

    def load(offset, seed):
        q_buf.copy_(torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(seed)).to(dev, torch.bfloat16))
        n = torch.tensor([x - offset for x in lengths], device=dev)
        n_buf.copy_(n)
        slot_buf.copy_(table[rows, n - 1].long())

    saved = (kmin.clone(), kmax.clone())
    load(1, seed=3)
    step()  # warm-up (Triton compiles outside the capture)
    kmin.copy_(saved[0]), kmax.copy_(saved[1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_buf = step()
    for offset, seed in ((1, 4), (0, 5)):  # token n-2 then n-1: summaries grow inside the graph
        load(offset, seed)
        graph.replay()
        got = out_buf.clone()
        after_graph = (kmin.clone(), kmax.clone())
        kmin.copy_(saved[0]), kmax.copy_(saved[1])
        want = step()  # eager from the same state
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        assert torch.equal(after_graph[0], kmin) and torch.equal(after_graph[1], kmax)
        saved = after_graph


@pytest.mark.gpu
def test_page_scores_kernel_on_cuda_equals_the_torch_path():
    lengths = [61, 5, 33]
    k_cache, _, table = paged_batch(lengths, seed=7)
    kmin, kmax = quest_pages.new_summaries(k_cache.shape[0], PAGE, HKV, D, torch.float32, "cpu")
    for i, n in enumerate(lengths):
        slots = table[i, :n].long()
        quest_pages.add_keys(kmin, kmax, k_cache[slots], slots, PAGE)
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(8))
    rows, n_rows = torch.tensor([1, 2, 0]), torch.tensor([5, 33, 61])
    want = quest_pages.page_scores(q, kmin, kmax, table, rows, n_rows, PAGE)  # torch path (CPU)
    got = quest_pages.page_scores(*(x.cuda() for x in (q, kmin, kmax, table, rows, n_rows)), PAGE)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_decode_fold_and_selection_kernels_on_cuda_equal_the_reference_at_quest_shapes():
    """The decode step's own kernels at 128K-context shapes (8,704 row-pages, 128 kept, 4
    requests x 32 query heads): one-launch summary fold == the scatter, one-program-per-row
    selection == the stable sort (same indices, ties to the lower page), a short request's -1s."""
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(4, 32, 8704, generator=g)
    scores[1, :, 900:] = float("-inf")  # a request with 900 pages
    scores[2, :, :64] = 3.0  # ties across the cut
    scores[3, :, 5:] = float("-inf")  # fewer pages than kept
    want = quest_pages.top_pages(scores, 128)  # CPU: the stable sort
    got = quest_pages.top_pages(scores.cuda(), 128)
    assert torch.equal(got.cpu(), want)
    kmin = torch.randn(600, 8, 128, generator=g).bfloat16()
    kmax = kmin + 1
    slots = torch.tensor([16 * 7, 16 * 9 + 5, 16 * 300 + 15, 16 * 41])
    k = torch.randn(4, 8, 128, generator=g).bfloat16()
    ref = (kmin.clone(), kmax.clone())
    quest_pages.add_keys(*ref, k, slots, 16)
    dev = (kmin.cuda(), kmax.cuda())
    quest_pages.add_decode_keys(*dev, k.cuda(), slots.cuda(), 16)
    pages = slots // 16
    assert torch.equal(dev[0].cpu()[pages], ref[0][pages]) and torch.equal(dev[1].cpu()[pages], ref[1][pages])
