"""``benchmark/bench_quest_recall.py``: the captured queries and keys are the ones the model's
attention uses, page summaries equal Quest's running fold, and the recall measure behaves as its
definition says (everything read: recall 1; an oracle never below the bound it upper-bounds)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_quest_recall as R  # noqa: E402

from sgl_kernel_sparse import reference  # noqa: E402


def test_page_summaries_equal_quests_fold_over_a_partial_last_page():
    k = torch.randn(3, 37, 8)  # [Hkv, L, D], 37 = 2 pages + 5 tokens
    kmin = torch.full((3, 3, 8), float("inf"))
    kmax = torch.full((3, 3, 8), float("-inf"))
    reference.quest_fold_keys(kmin, kmax, k.permute(1, 0, 2), torch.arange(37), R.PAGE)
    lo, hi = R.page_summaries(k)
    assert torch.equal(lo[0], kmin) and torch.equal(hi[0], kmax)


def layers(n=3, hq=6, hkv=2, length=200, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(hq, length, d, generator=g) * 2, torch.randn(hkv, length, d, generator=g))
            for _ in range(n)]


def test_recall_is_one_when_every_page_is_read_and_oracles_bound_the_rules():
    ls = layers()
    needle = torch.tensor([3, 4])
    full = R.measure(ls, 150, needle, n_sel=64, dense_layers=1)
    for rule in R.RULES:
        assert abs(full[rule]["recall"] - 1.0) < 1e-5 and full[rule]["needle"] == 1.0, (rule, full[rule])
        assert full[rule]["pages"] == 10  # ceil(151 / 16) pages, all of them
    few = R.measure(ls, 150, needle, n_sel=3, dense_layers=1)
    assert few["oracle_head"]["recall"] >= few["head"]["recall"] - 1e-6
    assert few["oracle_kv"]["recall"] >= few["kv_sum"]["recall"] - 1e-6
    assert few["oracle_kv"]["recall"] >= few["kv_softmax"]["recall"] - 1e-6
    assert few["kv_sum"]["pages"] == 3 and 3 <= few["head"]["pages"] <= 9  # a union of 3 heads' 3 pages
    assert 0 < few["head"]["recall"] < 1


def test_captured_queries_and_keys_give_the_models_attention_output():
    """Attention computed from the captured post-RoPE q / k (and the layer's v) equals what the
    model's attention module feeds its output projection."""
    from transformers import AutoModelForCausalLM

    from sglang_sparse.default_model import ensure_default_model

    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    ids = list(range(100, 140))
    seen = {}
    attn = model.model.layers[3].self_attn
    h1 = attn.o_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("o_in", a[0][0]))
    h2 = attn.v_proj.register_forward_hook(lambda m, a, out: seen.setdefault("v", out[0]))
    try:
        got = R.capture(model, ids)
    finally:
        h1.remove()
        h2.remove()
    assert len(got) == len(model.model.layers)
    q, k = got[3]  # [Hq, T, D], [Hkv, T, D]
    hq, t, d = q.shape
    group = hq // k.shape[0]
    v = seen["v"].view(t, k.shape[0], d).transpose(0, 1).repeat_interleave(group, 0)
    logits = q @ k.repeat_interleave(group, 0).transpose(1, 2) * attn.scaling
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = (torch.softmax(logits, -1) @ v).transpose(0, 1).reshape(t, hq * d)
    assert torch.allclose(out, seen["o_in"], atol=1e-4, rtol=1e-4)
