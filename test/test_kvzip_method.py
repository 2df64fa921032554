"""KVzip as a method on the toy engine (no SGLang): the probe prefilled after the context scores
it, one global keep ratio over layers and heads (sinks first) picks the entries, each layer keeps
its widest head's count in the per-layer store, the probe's rows are dropped and decode goes on
at the context's end; kept indices equal the formula, nothing leaks."""

from __future__ import annotations

import math

import pytest
import torch
from sgl_kernel_sparse import reference

from sglang_sparse.core.events import RequestSlice, StepMode
from sglang_sparse.methods.kvzip import CONTEXT_KEY, START_KEY, probe_tokens
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, D, ToyEngine, qkv

CTX, PROBE = 40, 50


def _formula(q, k, ratio, sinks):
    """Kept positions per layer ``[Hkv, B_l]`` from the definition, written out here: score =
    max over probe queries and GQA group of causal softmax attention; global top entries over
    (layer, head, position), sinks first, ties to the earlier entry; each layer widened to its
    widest head by that head's next-best positions."""
    scores = []
    for layer in range(LAYERS):
        qq, kk = q[layer][CTX:], k[layer].repeat_interleave(HQ // HKV, dim=1)
        logits = torch.einsum("shd,nhd->hsn", qq, kk) / math.sqrt(D)
        seen = torch.arange(CTX + PROBE).view(1, -1) <= torch.arange(CTX, CTX + PROBE).view(-1, 1)
        probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)[..., :CTX]
        scores.append(probs.amax(dim=1).view(HKV, HQ // HKV, CTX).amax(dim=1))
    s = torch.stack(scores)  # [layers, Hkv, CTX]
    entries = sorted(((layer, h, p) for layer in range(LAYERS) for h in range(HKV) for p in range(CTX)),
                     key=lambda e: (-(math.inf if e[2] < sinks else float(s[e])), e))
    kept = set(entries[: int(ratio * LAYERS * HKV * CTX)])
    out = []
    for layer in range(LAYERS):
        width = max(sum((layer, h, p) in kept for p in range(CTX)) for h in range(HKV))
        rows = []
        for h in range(HKV):
            ranked = sorted(range(CTX), key=lambda p: (0 if (layer, h, p) in kept else 1, -float(s[layer, h, p]), p))
            rows.append(sorted(ranked[:width]))
        out.append(torch.tensor(rows))
    return out


@pytest.mark.parametrize("chunk", [1000, 7])
def test_kvzip_keeps_the_formula_drops_the_probe_and_frees_each_layers_drops(chunk):
    ratio, sinks = 0.3, 4
    q, k, v = qkv(CTX + PROBE, seed=21)
    eng = ToyEngine("kvzip", {"keep_ratio": ratio, "sinks": sinks})
    free0 = eng.store.free_count()
    freed = eng.prefill("a", 0, q, k, v, chunk, metadata={CONTEXT_KEY: CTX})
    want = _formula(q, k, ratio, sinks)
    engine_rows = -(-sum(w.shape[1] for w in want) // LAYERS)
    assert freed == CTX + PROBE - engine_rows
    assert eng.store.free_count() == free0 - engine_rows
    ret = eng.ctl.cache.retained("a")
    assert ret.per_layer and (ret.n_rows, ret.logical_len) == (engine_rows, CTX)
    assert len({w.shape[1] for w in want}) > 1  # one global threshold: layers keep different counts
    for layer in range(LAYERS):
        assert torch.equal(ret.layer_positions(layer), want[layer])
        assert (want[layer][:, :sinks] == torch.arange(sinks)).all()
        for h in range(HKV):
            torch.testing.assert_close(eng.ctl.cache.keys("a", layer)[:, h], k[layer][want[layer][h], h])
            torch.testing.assert_close(eng.ctl.cache.values("a", layer)[:, h], v[layer][want[layer][h], h])
    dq, dk, dv = qkv(1, seed=22)  # decode continues at the context's end, not after the probe
    eng.decode("a", 0, dq, dk, dv)
    ret = eng.ctl.cache.retained("a")
    assert (ret.n_rows, ret.logical_len) == (engine_rows + 1, CTX + 1)
    assert ret.layer_positions(0)[:, -1].eq(CTX).all()
    torch.testing.assert_close(eng.ctl.cache.keys("a", 2)[-1], dk[2][0])
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_reference_mask_is_one_global_threshold():
    scores = torch.rand(3, 2, 10, generator=torch.Generator().manual_seed(3))
    mask = reference.kvzip_keep_mask(scores, 0.25, sinks=1)
    assert int(mask.sum()) == 15 and mask[..., 0].all()
    rest = scores.masked_fill(torch.zeros_like(mask).index_fill_(2, torch.tensor([0]), True), -1)
    assert rest[mask & (rest >= 0)].min() >= rest[~mask].max()  # every kept score >= every dropped


def test_probe_tokens_follow_the_chunked_layout():
    ctx = list(range(100, 110))
    got = probe_tokens(ctx, [1], [2], [9], chunk=4, tail=2)
    assert got == [1, 9, 100, 101, 102, 103, 2, 102, 103, 9, 104, 105, 106, 107, 2, 106, 107, 9, 108, 109]
    # a chain continuation's new context [7, 10): probed as a later chunk (repeat_part + tail)
    assert probe_tokens(ctx, [1], [2], [9], chunk=4, tail=2, start=7) == [2, 105, 106, 9, 107, 108, 109]
    assert probe_tokens(ctx, [1], [2], [], chunk=2, tail=1, start=6) == [2, 105, 106, 107, 2, 107, 108, 109]


NEW, PROBE2 = 20, 30  # a continuation's new context and its probe


def _continuation_formula(old_pos, old_k, new_q, new_k, start, ratio):
    """The continuation's kept positions per layer from the definition: the probe queries (after
    the new context ``[M, M + NEW)``) attend causally to the resumed rows (per head: positions
    ``old_pos[l][h]`` with keys ``old_k[l][h]``, all before them), the new context and the probe;
    scores of the new context only; one global selection over its entries (no sinks: M > 4);
    each layer widened to its widest head; the resumed positions all stay."""
    scores = []
    for layer in range(LAYERS):
        per_head = []
        for h in range(HKV):
            keys = torch.cat([old_k[layer][h], new_k[layer][:, h]])  # [R + NEW + PROBE2, D]
            r = old_k[layer][h].shape[0]
            qq = new_q[layer][NEW:].view(PROBE2, HKV, HQ // HKV, D)[:, h]  # [PROBE2, group, D]
            logits = torch.einsum("sgd,nd->gsn", qq, keys) / math.sqrt(D)
            rows = torch.arange(keys.shape[0]).view(1, -1)
            seen = rows <= (r + NEW + torch.arange(PROBE2)).view(-1, 1)
            probs = torch.softmax(logits.masked_fill(~seen, float("-inf")), -1)[..., r: r + NEW]
            per_head.append(probs.amax(dim=(0, 1)))
        scores.append(torch.stack(per_head))
    s = torch.stack(scores)  # [layers, Hkv, NEW]
    mask = reference.kvzip_keep_mask(s, ratio, sinks=0)
    from sglang_sparse.methods.kvzip import widen_to_layer

    return [torch.cat([old_pos[layer], start + widen_to_layer(mask[layer], s[layer])], dim=1)
            for layer in range(LAYERS)], int(mask.sum())


@pytest.mark.parametrize("chunk", [1000, 9])
def test_a_chain_continuation_scores_only_its_new_context_over_the_resumed_rows(chunk):
    """Turn 1 compacts as above and decodes 2 tokens; the chain resumes its rows (M = CTX + 2)
    and prefills NEW context tokens + their probe: the resumed rows stay, the new context keeps
    what the formula keeps over resumed + new keys, the probe's rows go, nothing leaks."""
    ratio = 0.3
    q, k, v = qkv(CTX + PROBE, seed=21)
    eng = ToyEngine("kvzip", {"keep_ratio": ratio})
    free0 = eng.store.free_count()
    eng.prefill("a", 0, q, k, v, 1000, metadata={CONTEXT_KEY: CTX})
    dec = [qkv(1, seed=30 + i) for i in range(2)]
    for dq, dk, dv in dec:
        eng.decode("a", 0, dq, dk, dv)
    ret, meta = eng.ctl.cache.retained("a"), dict(eng.ctl.cache.requests["a"].metadata)
    start = ret.logical_len
    assert start == CTX + 2
    old_pos = [ret.layer_positions(layer) for layer in range(LAYERS)]
    old_k = [[eng.ctl.cache.keys("a", layer)[:, h] for h in range(HKV)] for layer in range(LAYERS)]
    eng.ctl.request_finished("a")  # the chain keeps row 0 and its slots
    rows1 = ret.n_rows
    nq, nk, nv = qkv(NEW + PROBE2, seed=23)
    total = start + NEW + PROBE2
    eng.ctl.request_resumed("b", 0, total, ret, {**meta, CONTEXT_KEY: start + NEW, START_KEY: start})
    c0 = dict(eng.ctl.runtime.counters)
    freed = 0
    for lo in range(0, NEW + PROBE2, chunk):
        hi = min(lo + chunk, NEW + PROBE2)
        s = RequestSlice("b", 0, start + lo, start + hi, eng.ctl.cache.retained("b").n_rows, total)
        freed += eng.run_step(StepMode.PREFILL, [s], [x[lo:hi] for x in nq], [x[lo:hi] for x in nk],
                              [x[lo:hi] for x in nv])
    want, selected = _continuation_formula(old_pos, old_k, nq, nk, start, ratio)
    ret = eng.ctl.cache.retained("b")
    assert ret.logical_len == start + NEW
    assert 0 < selected < int(ratio * LAYERS * HKV * NEW) + 1
    for layer in range(LAYERS):
        assert torch.equal(ret.layer_positions(layer), want[layer]), layer
        kept = eng.ctl.cache.keys("b", layer)
        r = old_pos[layer].shape[1]
        for h in range(HKV):
            torch.testing.assert_close(kept[:r, h], old_k[layer][h])
            torch.testing.assert_close(kept[r:, h], nk[layer][want[layer][h, r:] - start, h])
    engine_rows = -(-sum(w.shape[1] for w in want) // LAYERS)
    assert freed == rows1 + NEW + PROBE2 - engine_rows
    c1 = eng.ctl.runtime.counters
    assert c1["kvzip_padded_entries"] - c0["kvzip_padded_entries"] == \
        sum(w.shape[1] - p.shape[1] for w, p in zip(want, old_pos)) * HKV - selected
    assert c1["rows_released"] - c0["rows_released"] == \
        sum(p.shape[1] + NEW + PROBE2 - w.shape[1] for w, p in zip(want, old_pos))
    eng.finish("b", 0)
    assert eng.store.free_count() == free0


def test_bad_options_get_a_sentence():
    with pytest.raises(ConfigError, match=r"keep_ratio=0.0 is out of range: must be in \(0, 1\]"):
        build_config("kvzip", {"keep_ratio": 0.0})
    with pytest.raises(ConfigError, match="sinks=-1 is out of range"):
        build_config("kvzip", {"sinks": -1})


def test_launcher_serves_kvzip_and_checks_its_flags():
    from sglang_sparse.srt.launcher import sparse_config

    config, _ = sparse_config(["--sparse-method", "kvzip", "--sparse-keep-ratio", "0.3"], log=lambda *_: None)
    assert config["method"] == "kvzip" and config["chain_cache"] is True  # auto: on, as for every evicting method
    with pytest.raises(ConfigError, match=r"keep_ratio=2.0 is out of range"):
        sparse_config(["--sparse-method", "kvzip", "--sparse-keep-ratio", "2"], log=lambda *_: None)
