"""OmniKV on the plain-torch engine (no SGLang): the filter layers' selection equals a reference
written from the formula (s_j = max_h softmax_j(q_h . k_j / sqrt d), top-k prompt tokens,
ascending), later layers read exactly that set plus every generated token, the latest filter
layer's set wins, layers before the first filter layer stay dense, nothing is evicted, and the
attention over the view equals reference attention over those tokens."""

from __future__ import annotations

import math

import pytest
import torch

import single_request as one
from sglang_sparse.kernels.decode import decode_over_views
from sglang_sparse.methods.omnikv import OmniKVConfig
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, D, ToyEngine, qkv


def reference_selection(q: torch.Tensor, k: torch.Tensor, prompt: int, budget: int) -> list[int]:
    """q [HQ, d], k [n, HKV, d]: loops over heads and tokens, as the paper's formula reads."""
    n, group = k.shape[0], HQ // HKV
    best = [0.0] * n
    for h in range(HQ):
        logits = [float(q[h] @ k[j, h // group]) / math.sqrt(D) for j in range(n)]
        m = max(logits)
        z = sum(math.exp(x - m) for x in logits)
        for j in range(n):
            best[j] = max(best[j], math.exp(logits[j] - m) / z)
    ranked = sorted(range(prompt), key=lambda j: (-best[j], j))[:budget]
    return sorted(ranked)


def run(filters: str, budget: int, length: int = 60, decodes: int = 3, seed: int = 1):
    q, k, v = qkv(length, seed=seed)
    eng = ToyEngine("omnikv", {"filter_layers": filters, "token_budget": budget})
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, chunk=25)
    ks, vs = [x.clone() for x in k], [x.clone() for x in v]
    steps = []
    for t in range(decodes):
        dq, dk, dv = qkv(1, seed=100 + t)
        ks = [torch.cat([a, b]) for a, b in zip(ks, dk)]
        vs = [torch.cat([a, b]) for a, b in zip(vs, dv)]
        eng.views.clear()
        eng.decode("a", 0, dq, dk, dv)
        steps.append((dq, [x.clone() for x in ks], [x.clone() for x in vs], dict(eng.views)))
    assert eng.store.free_count() == free0 - length - decodes  # nothing evicted
    return eng, free0, steps, length


@pytest.mark.parametrize("budget", [7, 20])
def test_selection_equals_the_reference_and_generated_tokens_are_always_read(budget):
    eng, free0, steps, length = run("1", budget)
    for t, (dq, ks, vs, views) in enumerate(steps):
        n = length + t + 1
        assert views[0] is None and views[1] is None  # before the filter layer, and the filter layer: dense
        want = reference_selection(dq[1][0], ks[1], length, budget)
        rows = views[2].rows[0]
        assert rows.shape == (HQ, budget + t + 1)
        for h in range(HQ):  # the same set for every head: the chosen prompt rows, then generated
            assert rows[h].tolist() == want + list(range(length, n))
        mask = torch.zeros(HQ, n, dtype=torch.bool)
        mask[:, rows[0]] = True
        expected = one.masked_decode_attention(dq[2][0], ks[2], vs[2], mask)
        dense = one.masked_decode_attention(dq[2][0], ks[2], vs[2], torch.ones_like(mask))
        assert not torch.allclose(expected, dense)  # the selection changes what is read
        out = decode_over_views(dq[2], eng.store.k[2], eng.store.v[2], eng.store.table, [0],
                                list(views[2].rows), list(views[2].valid), [n], 1 / D ** 0.5)
        torch.testing.assert_close(out[0], expected, rtol=1e-5, atol=1e-5)
    counters = eng.ctl.stats()["counters"]
    assert counters["rows_read"] == sum(budget + t + 1 for t in range(3))
    assert counters["rows_resident"] == sum(length + t + 1 for t in range(3))
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_the_latest_filter_layer_sets_what_later_layers_read():
    _, _, steps, length = run("0,1", 10, decodes=1)
    dq, ks, _, views = steps[0]
    assert views[0] is None and views[1] is None
    latest = reference_selection(dq[1][0], ks[1], length, 10)
    first = reference_selection(dq[0][0], ks[0], length, 10)
    assert latest != first  # the two filter layers disagree on these tensors, so the test can tell
    assert views[2].rows[0][0].tolist() == latest + [length]


def test_a_prompt_within_the_budget_is_read_in_full():
    _, _, steps, _ = run("1", 60)
    assert all(views[2] is None for *_, views in steps)


def test_config_is_validated_with_a_sentence():
    assert OmniKVConfig().layers == (2, 8, 18)
    for bad in ("2,x", "8,2", "2,2", "-1"):
        with pytest.raises(ConfigError, match="filter_layers"):
            build_config("omnikv", {"filter_layers": bad})
    with pytest.raises(ConfigError, match="token_budget"):
        build_config("omnikv", {"token_budget": 0})
    with pytest.raises(ConfigError, match=f"the model has {LAYERS} layers"):
        ToyEngine("omnikv", {"filter_layers": f"1,{LAYERS}"})
