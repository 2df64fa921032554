"""Pruning policies (core/pruning.py) against plain loops over the same tensors."""

import math

import pytest
import torch

from sgl_kernel_sparse import reference as R

from sglang_sparse.core import pruning


def _probs_reference(q, keys, q_rows, scale):
    s, hq, _ = q.shape
    n, hkv, _ = keys.shape
    out = torch.zeros(hq, s, n)
    for h in range(hq):
        kh = h // (hq // hkv)
        for i in range(s):
            vis = int(q_rows[i]) + 1
            logits = torch.tensor([float(q[i, h] @ keys[j, kh]) * scale for j in range(vis)])
            out[h, i, :vis] = torch.softmax(logits, 0)
    return out


def _setup(seed=0, s=5, hq=4, hkv=2, d=8, n=30):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, hq, d, generator=g)
    keys = torch.randn(n, hkv, d, generator=g)
    q_rows = torch.arange(n - s, n)
    return q, keys, q_rows, 1 / math.sqrt(d)


def test_attention_probs_match_the_loop():
    q, keys, q_rows, scale = _setup()
    got = R.attention_probs(q, keys, q_rows, scale)
    assert torch.allclose(got, _probs_reference(q, keys, q_rows, scale), atol=1e-5)


def test_snapkv_scores_match_the_loop():
    q, keys, q_rows, scale = _setup(1)
    probs = _probs_reference(q, keys, q_rows, scale)
    cols = torch.arange(3, 20)  # the interval's rows
    got = pruning.layer_scores("snapkv", probs[:, :, cols])
    k, m = R.SNAPKV_KERNEL, cols.numel()
    want = torch.full((m,), -math.inf)
    for h in range(probs.shape[0]):
        summed = [float(probs[h, :, c].sum()) for c in cols]
        for j in range(m):  # avg_pool1d, zero padding counted
            window = [summed[t] for t in range(j - k // 2, j + k // 2 + 1) if 0 <= t < m]
            want[j] = max(want[j], sum(window) / k)
    assert torch.allclose(got, want, atol=1e-6)


def test_kvzip_scores_match_the_loop():
    q, keys, q_rows, scale = _setup(2)
    probs = _probs_reference(q, keys, q_rows, scale)
    cols = torch.arange(0, 12)
    got = pruning.layer_scores("kvzip", probs[:, :, cols])
    want = torch.tensor([max(float(probs[h, i, c]) for h in range(4) for i in range(5)) for c in cols])
    assert torch.allclose(got, want, atol=1e-6)


def test_blocks_of_queries_combine_to_the_whole():
    q, keys, q_rows, scale = _setup(3, s=9)
    probs = R.attention_probs(q, keys, q_rows, scale)
    for policy in pruning.POLICIES:
        whole = pruning.reduce_queries(policy, probs)
        parts = pruning.combine(policy, pruning.reduce_queries(policy, probs[:, :4]),
                                pruning.reduce_queries(policy, probs[:, 4:]))
        assert torch.allclose(whole, parts, atol=1e-6)


def test_keep_mask_top_k_ties_pages_and_sinks():
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.2, 0.9])
    pos = torch.arange(10, 16)
    assert pruning.keep_mask(scores, pos, 3).tolist() == [False, True, True, False, False, True]
    assert pruning.keep_mask(scores, pos, 0).sum() == 0
    # pages of 2 over positions 10..15: pages (0.9, 0.5, 0.9) -> keep 1 page: the earlier 0.9
    assert pruning.keep_mask(scores, pos, 2, page=2).tolist() == [True, True, False, False, False, False]
    always = torch.tensor([True, False, False, False, False, False])
    assert pruning.keep_mask(scores, pos, 2, always=always).tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("ratio,tokens,msg", [
    (None, None, "exactly one"), (0.5, 3, "exactly one"), (1.5, None, "between 0 and 1"),
    (None, 11, "more than the 10"), (None, -1, "non-negative"),
])
def test_keep_count_rejects_bad_targets(ratio, tokens, msg):
    with pytest.raises(pruning.PruneRequestError, match=msg):
        pruning.keep_count(10, ratio, tokens, 1)


def test_keep_count_rounds_to_pages():
    assert pruning.keep_count(40, 0.5, None, 16) == 16
    assert pruning.keep_count(40, None, 0, 16) == 0
    with pytest.raises(pruning.PruneRequestError, match="unknown policy"):
        pruning.check_policy("h2o")
