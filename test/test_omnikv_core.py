"""OmniKV on the plain-torch engine (no SGLang): the filter layers' selection equals a reference
written from the formula (s_j = max_h softmax_j(q_h . k_j / sqrt d), top-k prompt tokens,
ascending), later layers read exactly that set plus every generated token, the latest filter
layer's set wins, layers before the first filter layer stay dense, nothing is evicted, and the
attention over the view equals reference attention over those tokens. The decode hook is the
tensor-only one SGLang's CUDA graphs capture (``decode_view_tensors``)."""

from __future__ import annotations

import math

import pytest
import torch

import single_request as one
from sglang_sparse.core.views import RowsTailDecodeView
from sglang_sparse.kernels.decode import decode_over_rows_tail
from sglang_sparse.methods.omnikv import OmniKVConfig, OmniKVRuntime
from sglang_sparse.registry import ConfigError, build_config
from sglang_sparse.core.events import RequestSlice, StepMode
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


def snapshot(views) -> dict:
    """The step's views by layer, copied: a view names the method's persistent buffers, which the
    next step overwrites (as a replayed CUDA graph would)."""
    return {layer: None if v is None else RowsTailDecodeView(*(t.clone() for t in (v.sel_rows, v.tail_start, v.n_rows)))
            for layer, v in views}


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
        steps.append((dq, [x.clone() for x in ks], [x.clone() for x in vs], snapshot(eng.views)))
    assert eng.store.free_count() == free0 - length - decodes  # nothing evicted
    return eng, free0, steps, length


def chosen(view: RowsTailDecodeView, b: int = 0) -> list[int]:
    return sorted(x for x in view.sel_rows[b].tolist() if x >= 0)


@pytest.mark.parametrize("budget", [7, 20])
def test_selection_equals_the_reference_and_generated_tokens_are_always_read(budget):
    eng, free0, steps, length = run("1", budget)
    assert OmniKVRuntime.graph_decode and not OmniKVRuntime.decode_needs_python()
    for t, (dq, ks, vs, views) in enumerate(steps):
        n = length + t + 1
        assert views[0] is None and views[1] is None  # before the filter layer, and the filter layer: dense
        want = reference_selection(dq[1][0], ks[1], length, budget)
        view = views[2]
        assert isinstance(view, RowsTailDecodeView) and view.sel_rows.shape == (1, budget)
        assert chosen(view) == want  # the chosen prompt rows ...
        assert view.tail_start.tolist() == [length] and view.n_rows.tolist() == [n]  # ... then generated
        mask = torch.zeros(HQ, n, dtype=torch.bool)
        mask[:, want + list(range(length, n))] = True
        expected = one.masked_decode_attention(dq[2][0], ks[2], vs[2], mask)
        dense = one.masked_decode_attention(dq[2][0], ks[2], vs[2], torch.ones_like(mask))
        assert not torch.allclose(expected, dense)  # the selection changes what is read
        out = decode_over_rows_tail(dq[2], eng.store.k[2], eng.store.v[2], eng.store.table, torch.tensor([0]),
                                    view.sel_rows, view.tail_start, view.n_rows, 1 / D ** 0.5)
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
    assert chosen(views[2]) == latest and views[2].tail_start.tolist() == [length]


def test_a_prompt_within_the_budget_is_read_in_full():
    _, _, steps, length = run("1", 60)
    for t, (*_, views) in enumerate(steps):  # every prompt row chosen, then the generated ones
        assert chosen(views[2]) == list(range(length)) and views[2].n_rows.tolist() == [length + t + 1]


def test_requests_of_one_batch_choose_from_their_own_rows():
    """Two requests decoded in one step: each one's selection is its own (batch positions of the
    persistent buffer do not mix), and each reads its own prompt/generated boundary."""
    eng = ToyEngine("omnikv", {"filter_layers": "1", "token_budget": 5})
    qa, ka, va = qkv(30, seed=7)
    qb, kb, vb = qkv(12, seed=8)
    eng.prefill("a", 0, qa, ka, va, chunk=30)
    eng.prefill("b", 3, qb, kb, vb, chunk=12)
    dq, dk, dv = qkv(2, seed=9)
    eng.views.clear()
    ra, rb = eng.ctl.cache.retained("a"), eng.ctl.cache.retained("b")
    slices = [RequestSlice("a", 0, 30, 31, ra.n_rows, 30), RequestSlice("b", 3, 12, 13, rb.n_rows, 12)]
    eng.run_step(StepMode.DECODE, slices, dq, dk, dv)
    view = snapshot(eng.views)[2]
    for b, (k, length) in enumerate(((ka, 30), (kb, 12))):
        keys = torch.cat([k[1], dk[1][b : b + 1]])
        assert chosen(view, b) == reference_selection(dq[1][b], keys, length, 5)
    assert view.tail_start.tolist() == [30, 12] and view.n_rows.tolist() == [31, 13]


def test_config_is_validated_with_a_sentence():
    assert OmniKVConfig().layers == (2, 8, 18)
    for bad in ("2,x", "8,2", "2,2", "-1"):
        with pytest.raises(ConfigError, match="filter_layers"):
            build_config("omnikv", {"filter_layers": bad})
    with pytest.raises(ConfigError, match="token_budget"):
        build_config("omnikv", {"token_budget": 0})
    with pytest.raises(ConfigError, match=f"the model has {LAYERS} layers"):
        ToyEngine("omnikv", {"filter_layers": f"1,{LAYERS}"})
