"""SnapKV's optional sinks and recent window: the first ``sinks`` and last ``max(recent, w)``
prompt positions are kept inside the budget, the rest of the budget by pooled score; the
defaults (0 / 0) are the published SnapKV exactly. Checked against a formula written here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from sgl_kernel_sparse import reference

from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, LAYERS, ToyEngine, qkv


def _formula(q_win, k, budget, window, kernel, sinks, recent):
    """Kept positions per KV head, from the definition: fixed = sinks + last max(recent, w);
    the other candidates of ``[0, L-w)`` ranked by the pooled window score (GQA mean, ties to
    the lower position), the best ``budget - |fixed|`` of them join."""
    length, hkv, d = k.shape
    hq, w = q_win.shape[1], q_win.shape[0]
    kk = k.repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("whd,nhd->hwn", q_win, kk) / d ** 0.5
    qpos = torch.arange(length - w, length).view(-1, 1)
    logits = logits.masked_fill(torch.arange(length).view(1, -1) > qpos, float("-inf"))
    s = torch.softmax(logits, -1).sum(1).view(hkv, hq // hkv, length).mean(1)[:, : length - w]
    s = F.avg_pool1d(s.unsqueeze(1), kernel, 1, kernel // 2).squeeze(1)
    fixed = set(range(sinks)) | set(range(length - max(recent, w), length))
    out = []
    for h in range(hkv):
        ranked = sorted((p for p in range(length - w) if p not in fixed), key=lambda p: (-float(s[h, p]), p))
        out.append(sorted(fixed | set(ranked[: budget - len(fixed)])))
    return torch.tensor(out)


@pytest.mark.parametrize("sinks,recent", [(0, 0), (4, 0), (0, 20), (3, 12)])
def test_reference_keeps_sinks_and_recent_inside_the_budget(sinks, recent):
    q, k, _ = qkv(90, seed=11)
    budget, window, kernel = 30, 6, 5
    for layer in range(LAYERS):
        got = reference.snapkv_keep_indices(q[layer][-window:], k[layer], budget, window, kernel,
                                            sinks=sinks, recent=recent)
        assert got.shape == (HKV, budget)
        want = _formula(q[layer][-window:], k[layer], budget, window, kernel, sinks, recent)
        assert torch.equal(got, want)


def test_defaults_are_published_snapkv():
    q, k, _ = qkv(70, seed=12)
    plain = reference.snapkv_keep_indices(q[0][-8:], k[0], 20, 8, 7)
    off = reference.snapkv_keep_indices(q[0][-8:], k[0], 20, 8, 7, sinks=0, recent=0)
    assert torch.equal(plain, off)
    assert build_config("snapkv", {}).sinks == 0 and build_config("snapkv", {}).recent == 0


@pytest.mark.parametrize("chunk", [1000, 13])
def test_snapkv_method_keeps_the_formula_and_frees_the_rest(chunk):
    length, budget, window, sinks, recent = 80, 24, 4, 3, 10
    q, k, v = qkv(length, seed=13)
    eng = ToyEngine("snapkv", {"budget": budget, "window": window, "kernel": 3, "sinks": sinks, "recent": recent})
    free0 = eng.store.free_count()
    assert eng.prefill("a", 0, q, k, v, chunk) == length - budget
    ret = eng.ctl.cache.retained("a")
    for layer in range(LAYERS):
        want = _formula(q[layer][-window:], k[layer], budget, window, 3, sinks, recent)
        assert torch.equal(ret.positions[layer], want)
        assert (ret.positions[layer][:, :sinks] == torch.arange(sinks)).all()
    assert eng.store.free_count() == free0 - budget
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_forced_positions_must_fit_the_budget():
    with pytest.raises(ConfigError, match=r"sinks=64 plus recent=512 .* is 576 positions, more than budget=256"):
        build_config("snapkv", {"budget": 256, "sinks": 64, "recent": 512})
    with pytest.raises(ConfigError, match="sinks=-1 is out of range"):
        build_config("snapkv", {"sinks": -1})
    build_config("snapkv", {"budget": 1024, "sinks": 64, "recent": 512})
