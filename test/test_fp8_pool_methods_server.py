"""A sparse method on SGLang's fp8 KV cache (CPU, real server): ``--sparse-method h2o
--kv-cache-dtype fp8_e4m3``. The pool stores fp8 keys; H2O scores prompt chunks and decode steps
from them (``SlotScores``: the attention-sums reference on the CPU, the Triton kernel converting
each fp8 key tile on CUDA), evicts per KV head between prompt chunks and while decoding, and
every eviction frees exactly the rows over the budget. Nothing leaks once the chain is gone.
(KVzip and PyramidKV refuse an fp8 KV cache at launch: ``test_launcher_unit.py``.)"""

from __future__ import annotations

import json
import time

import pytest
import requests

from conftest import sparse_stats as stats
from conftest import start_server

POOL, CHUNK, BUDGET, INTERVAL = 2048, 64, 48, 8
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
        "--kv-cache-dtype", "fp8_e4m3", "--sparse-method", "h2o", "--sparse-budget", str(BUDGET),
        "--sparse-recent", "12", "--sparse-interval", str(INTERVAL)]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_h2o_evicts_on_an_fp8_pool_and_frees_what_it_evicts(server, default_model_dir):
    from sglang_sparse.core.kv_budget import kv_bytes_per_token

    config = json.loads((default_model_dir / "config.json").read_text())
    before = stats(server)
    for _ in range(120):  # the server's warm-up request, if still running, parks its chain first
        if before["running_requests"] == 0:
            break
        time.sleep(0.5)
        before = stats(server)
    assert before["kv_bytes_per_token"] * 2 == kv_bytes_per_token(config, "bfloat16")  # the pool is fp8
    prompt, new = 300, 20
    body = {"input_ids": [1000 + (11 * j) % 20000 for j in range(prompt)],
            "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
    resp = requests.post(server.base_url + "/generate", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["meta_info"]["completion_tokens"] == new
    after = stats(server)
    count = {k: after["counters"].get(k, 0) - before["counters"].get(k, 0)
             for k in ("evictions", "rows_released", "slots_released", "decode_compactions")}
    kept = BUDGET + (new - 1) % INTERVAL  # rows the chain parks
    # 19 decode forwards write KV: decode evictions after 8 and 16 of them
    assert count["decode_compactions"] == (new - 1) // INTERVAL
    assert count["evictions"] > count["decode_compactions"]  # and between prompt chunks
    assert count["rows_released"] == count["slots_released"] == prompt + new - 1 - kept
    assert after["integrity"]["ok"], after["integrity"]
    assert after["kv_free_slots"] == before["kv_free_slots"] - kept
    chain_id = out["meta_info"]["chain_id"]
    assert requests.delete(f"{server.base_url}/chain/{chain_id}", timeout=60).status_code == 200
    end = stats(server)
    assert end["kv_free_slots"] == before["kv_free_slots"]  # the chain's rows are back
    # the census: every slot free or owned once (the server's warm-up request may hold a chain)
    assert end["integrity"]["ok"] and end["integrity"]["free"] + end["integrity"]["owned"] == end["kv_total_slots"]
