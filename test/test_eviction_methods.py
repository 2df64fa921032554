"""Eviction methods on the toy engine (no SGLang): StreamingLLM keeps exactly sinks + recent,
PyramidKV's per-layer budgets and kept indices equal a reference written from the formulas, and
its compaction frees each layer's own dropped rows; nothing leaks."""

from __future__ import annotations

import pytest
import torch

from toy_engine import HKV, LAYERS, ToyEngine, qkv


def _expected_streaming(n: int, sinks: int, recent: int) -> torch.Tensor:
    if n <= sinks + recent:
        return torch.arange(n)
    return torch.cat([torch.arange(sinks), torch.arange(n - recent, n)])


@pytest.mark.parametrize("chunk", [64, 7])
def test_streamingllm_keeps_exactly_sinks_and_recent_after_every_step(chunk):
    sinks, recent = 2, 8
    q, k, v = qkv(40, seed=5)
    eng = ToyEngine("streamingllm", {"sinks": sinks, "recent": recent, "evict_every": 1})
    free0 = eng.store.free_count()
    assert eng.prefill("a", 0, q, k, v, chunk) == 40 - sinks - recent
    keys = [k[layer].clone() for layer in range(LAYERS)]
    for step in range(20):
        dq, dk, dv = qkv(1, seed=100 + step)
        eng.decode("a", 0, dq, dk, dv)
        for layer in range(LAYERS):
            keys[layer] = torch.cat([keys[layer], dk[layer]])
        ret = eng.ctl.cache.retained("a")
        want = _expected_streaming(ret.logical_len, sinks, recent)
        assert ret.n_rows == sinks + recent
        assert torch.equal(ret.positions, want.expand(LAYERS, HKV, -1))  # every layer and head
        for layer in range(LAYERS):  # and the rows hold those tokens' keys
            torch.testing.assert_close(eng.ctl.cache.keys("a", layer), keys[layer][want])
    assert eng.store.free_count() == free0 - (sinks + recent)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_streamingllm_evicts_every_n_tokens_and_stays_bounded():
    sinks, recent, every = 4, 16, 5
    q, k, v = qkv(10, seed=6)  # a short prompt: nothing to evict yet
    eng = ToyEngine("streamingllm", {"sinks": sinks, "recent": recent, "evict_every": every}, slots=64)
    free0 = eng.store.free_count()
    assert eng.prefill("a", 0, q, k, v, chunk=4) == 0
    seen = []
    for step in range(200):  # 210 tokens through a 64-slot pool
        dq, dk, dv = qkv(1, seed=300 + step)
        freed = eng.decode("a", 0, dq, dk, dv)
        ret = eng.ctl.cache.retained("a")
        seen.append(ret.n_rows)
        assert ret.n_rows <= sinks + recent + every
        if freed:
            assert freed == every and ret.n_rows == sinks + recent
            assert torch.equal(ret.positions[0, 0], _expected_streaming(ret.logical_len, sinks, recent))
    assert max(seen) == sinks + recent + every - 1 and min(seen[30:]) == sinks + recent
    assert eng.ctl.stats()["counters"]["slots_released"] == 210 - sinks - recent - (seen[-1] - sinks - recent)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0


def test_streamingllm_oracle_caps_decode_growth():
    from sglang_sparse.methods.streamingllm import StreamingLLMConfig, StreamingLLMRuntime
    from sglang_sparse.core.cache_manager import CacheManager
    from sglang_sparse.core.kv_store import TensorKVStore

    rt = StreamingLLMRuntime(CacheManager(TensorKVStore(1, 8, 1, 4), 1), StreamingLLMConfig(4, 100, 16))
    o = rt.oracle
    assert o.rows_after_prefill(1000) == 104 and o.rows_at(1000, 10_000) == 120
    assert o.decode_reserve(1000, 10_000) == 0  # the prompt's own rows cover the whole decode
    assert o.rows_at(10, 50) == 60 and o.rows_at(10, 500) == 120
    assert o.decode_growth(1000, 10_000) == 16
