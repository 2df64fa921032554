"""DeltaKV at its defaults (latent 64, a reference every 16 tokens, 4 fathers) holds more requests
resident than dense could in the same pool (CPU, default model in 16 bits; accounting, not time).
A block keeps per token 64 code numbers, 4 int32 fathers and a sixteenth of a 384-wide reference:
5,760 B against 23,040 for the model's KV. The pool is 2,048 tokens of the model's KV: half its
bytes stay SGLang's slots (a prompt is prefilled there, then its history moves into blocks,
keeping a residual of 32 to 63 tokens), half become blocks (4,096 tokens). Dense in that pool holds
at most 2,048 // 300 = 6 prompts of 300 tokens; ten such requests sent together are all resident
at one step (``peak_running_requests``), each greedily generates its 8 tokens through the lossy
default compressor, and every slot and block comes back afterwards."""

from __future__ import annotations

import pytest
import requests

from conftest import distinct_burst, sparse_stats as stats, start_server

POOL, L, N, K = 2048, 300, 8, 10
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "deltakv", "--sparse-group", "32", "--sparse-residual", "32", "--sparse-fp-fraction", "0.5",
        "--chain-cache", "off"]
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_ten_requests_where_dense_holds_six(server):
    idle = stats(server)
    assert idle["kv_bytes_per_token"] == LAYERS * (64 * 2 + 4 * 4 + 384 * 2 / 16) == 5760
    assert idle["kv_bytes_per_slot"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # the model's 16-bit KV
    assert K > POOL // L  # dense: not even the prompts fit together
    assert idle["kv_total_slots"] == POOL // 2 and idle["peak_running_requests"] <= 1
    assert idle["method_static_bytes"] == LAYERS * (2 * 64 * 384 + 384) * 4  # the compressor: not KV
    outs = distinct_burst(server, K, L, N)
    assert len({tuple(r.json()["output_ids"]) for r in outs}) > 1  # distinct prompts, distinct texts
    after = stats(server)
    assert after["peak_running_requests"] == K
    assert after["counters"]["deltakv_blocks_written"] >= K * ((L - 32) // 32)
    assert after["counters"].get("deltakv_store_full", 0) == 0 and after["integrity"]["ok"]
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert done["kv_free_slots"] == idle["kv_free_slots"] and done["kv_bytes_used"] == idle["kv_bytes_used"]
