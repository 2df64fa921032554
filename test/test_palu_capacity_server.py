"""Palu at ratio 0.75 holds more requests resident than dense could in the same pool (CPU, default
model in fp16; accounting, not time). A latent block keeps a quarter of the model's K/V channels
(rank 16 of 64 per KV head, K and V): 5,760 B per token against 23,040 for the model's KV. The
pool is 2,048 tokens of the model's KV: half its bytes stay SGLang's slots (a prompt is prefilled
there, then its history moves to latent blocks, keeping a residual of 32 to 63 tokens), half become
blocks (4,096 tokens' latents). Dense in that pool holds at most 2,048 // 300 = 6 prompts of 300
tokens; ten such requests sent together are all resident at one step (``peak_running_requests``),
each completes its 8 tokens, and every slot and block comes back afterwards.

It also shows that the low-rank projection is live in the server: every row moved into a block lies in
the 16-dimensional span of its head's B (``palu_residual_ppm_max``, which only the projection hook
can make true at rank 16 < 64)."""

from __future__ import annotations

import pytest
import requests

from conftest import distinct_burst, sparse_stats as stats, start_server

POOL, L, N, K = 2048, 300, 8, 10
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "palu", "--sparse-ratio", "0.75", "--sparse-group", "32",
        "--sparse-residual", "32", "--sparse-fp-fraction", "0.5", "--chain-cache", "off"]
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_ten_requests_where_dense_holds_six(server):
    idle = stats(server)
    assert idle["kv_bytes_per_token"] == LAYERS * 2 * KV_HEADS * 16 * 2 == 5760  # rank 16, fp16 latents
    assert idle["kv_bytes_per_slot"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # the model's fp16 KV
    assert K > POOL // L  # dense: not even the prompts fit together
    assert idle["kv_total_slots"] == POOL // 2 and idle["peak_running_requests"] <= 1
    assert idle["method_static_bytes"] > 0  # the factors: not KV, reported apart
    distinct_burst(server, K, L, N)
    after = stats(server)
    assert after["peak_running_requests"] == K
    assert after["counters"]["palu_blocks_written"] >= K * ((L - 32) // 32)
    assert after["counters"].get("palu_store_full", 0) == 0 and after["integrity"]["ok"]
    # fp16 rows recovered through pinv(B): within fp16 rounding of the span (a full-rank row
    # written without the projection would be ~50% off at rank 16 of 64)
    assert after["counters"]["palu_residual_ppm_max"] < 5_000, after["counters"]  # measured: ~400
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert done["kv_free_slots"] == idle["kv_free_slots"] and done["kv_bytes_used"] == idle["kv_bytes_used"]
