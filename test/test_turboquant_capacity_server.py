"""TurboQuant holds more requests resident than dense could in the same pool (CPU, default model,
4 bits; accounting, not time). The pool is 2,048 tokens of the model's bf16 KV: half its bytes
stay SGLang's slots (a prompt is prefilled there, then its history moves to blocks, keeping a
residual of 32 to 63 tokens), half become TurboQuant blocks (3.76x fewer bytes per token). Dense
in that pool holds at most 2,048 // 300 = 6 prompts of 300 tokens, outputs aside; ten such
requests sent together are all resident at one step (``peak_running_requests``), each completes
its 8 tokens, and every slot and block comes back afterwards."""

from __future__ import annotations

import pytest
import requests

from conftest import distinct_burst, sparse_stats as stats, start_server

POOL, L, N, K = 2048, 300, 8, 10
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "turboquant", "--sparse-bits", "4", "--sparse-group", "32",
        "--sparse-residual", "32", "--sparse-fp-fraction", "0.5", "--chain-cache", "off"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_twice_the_requests_dense_could_hold_are_resident_together(server):
    idle = stats(server)
    assert K > POOL // L  # dense: not even the prompts fit together
    assert idle["kv_total_slots"] == POOL // 2 and idle["peak_running_requests"] <= 1
    distinct_burst(server, K, L, N)
    after = stats(server)
    assert after["peak_running_requests"] == K
    assert after["counters"]["turboquant_blocks_written"] >= K * ((L - 32) // 32)
    assert after["counters"].get("turboquant_store_full", 0) == 0 and after["integrity"]["ok"]
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert done["kv_free_slots"] == idle["kv_free_slots"] and done["kv_bytes_used"] == idle["kv_bytes_used"]
