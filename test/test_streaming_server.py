"""StreamingLLM through the real server (CPU): one request decodes four times the pool's token
capacity while ``kv_bytes_used`` stays flat (sinks + recent + at most ``evict_every`` rows), the
slot census stays clean, and the pool is whole afterwards."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import assert_every_slot_owned_once, run_together, start_server

POOL, SINKS, RECENT, EVERY = 160, 4, 32, 16
ARGS = ["--max-total-tokens", str(POOL), "--context-length", "2048", "--chunked-prefill-size", "64",
        "--log-level", "warning", "--chain-cache", "off",
        "--sparse-method", "streamingllm", "--sparse-sinks", str(SINKS), "--sparse-recent", str(RECENT),
        "--sparse-evict-every", str(EVERY)]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def test_one_request_decodes_four_pools_with_flat_kv_bytes(server):
    idle = stats(server)
    assert idle["kv_bytes_total"] == POOL * idle["kv_bytes_per_token"]
    new_tokens = 4 * POOL
    body = {"text": "Tell me a long story about a fox and a river. " * 8,  # ~90 prompt tokens
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}}
    out, samples = {}, []

    def run():
        out["resp"] = requests.post(server.base_url + "/generate", json=body, timeout=1800)

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        s = stats(server)
        if s["running_requests"] and s["logical_tokens"] > 120:  # decoding (prompt compacted)
            samples.append(s)
        time.sleep(0.5)
    t.join()
    resp = out["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] == new_tokens
    assert len(samples) >= 5, "too few samples while decoding"
    per_token = idle["kv_bytes_per_token"]
    used = [s["kv_bytes_used"] for s in samples]
    # sinks + recent + up to evict_every rows, whatever the logical length (up to 4x the pool)
    assert max(used) <= (SINKS + RECENT + EVERY) * per_token, used
    assert min(used) >= (SINKS + RECENT) * per_token, used
    assert max(s["logical_tokens"] for s in samples) > 3 * POOL
    assert all(s["integrity"]["ok"] for s in samples)
    done = stats(server)
    assert done["kv_free_slots"] == POOL  # everything went back to SGLang's allocator
    assert done["counters"]["slots_released"] >= new_tokens
    assert_every_slot_owned_once(server)


def test_bad_options_are_refused_with_a_sentence():
    from sglang_sparse.registry import ConfigError, build_config

    with pytest.raises(ConfigError, match="recent=0 is out of range"):
        build_config("streamingllm", {"recent": 0})
    with pytest.raises(ConfigError, match="evict_every=0 is out of range"):
        build_config("streamingllm", {"evict_every": 0})


def test_running_requests_reserve_only_up_to_their_row_cap(server):
    """Admission: a running StreamingLLM request never grows past sinks + recent + evict_every
    rows, so it reserves at most that (``MemoryOracle.growth_left``), not every token it may still
    decode. Three requests with 200-token outputs then run together in a 160-slot pool; with
    SGLang's own reservation (200 rows each) the first one would keep the others waiting."""
    free0 = stats(server)["kv_free_slots"]
    body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 200, "ignore_eos": True,
                                                             "temperature": 0}}
    outs, peak = run_together(server, [lambda: requests.post(server.base_url + "/generate", json=body,
                                                             timeout=1800)] * 3)
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 200 for r in outs)
    assert peak == 3, f"at most {peak} of 3 requests ran together"
    s = stats(server)
    assert s["kv_free_slots"] == free0 and s["integrity"]["ok"]
