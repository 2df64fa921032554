"""SnapKV through the real server (CPU): compaction after the last prompt chunk releases exactly
the evicted slots to SGLang's allocator, decoding continues, a small pool holds several times
more long requests than dense arithmetic allows, and nothing leaks."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import run_together, start_server

BUDGET, WINDOW, POOL, CHUNK = 64, 8, 2048, 128
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
        "--chain-cache", "off",  # these tests count free slots; idle chains would hold some (test_chain_server)
        "--sparse-method", "snapkv", "--sparse-budget", str(BUDGET), "--sparse-window", str(WINDOW)]
FOX = "The quick brown fox jumps over the lazy dog near the river bank. " * 40


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def generate(server, body) -> dict:
    resp = requests.post(server.base_url + "/generate", json=body, timeout=1800)
    assert resp.status_code == 200, resp.text
    return resp.json()


def peak_running(server, bodies) -> int:
    """Send all requests at once; the most requests running together, polled from the stats."""
    return run_together(server, [lambda b=b: generate(server, b) for b in bodies])[1]


def test_compaction_releases_exactly_the_evicted_slots(server):
    before = stats(server)
    assert before["kv_free_slots"] == before["kv_total_slots"] == POOL
    body = {"text": chat(FOX + "What does the fox do?"),
            "sampling_params": {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True}}
    result, seen = {}, []
    worker = threading.Thread(target=lambda: result.update(generate(server, body)))
    worker.start()
    while worker.is_alive():
        s = stats(server)
        if s["running_requests"] == 1 and s["counters"]["compactions"] == before["counters"]["compactions"] + 1:
            seen.append(s)
        time.sleep(0.3)
    worker.join()
    prompt = result["meta_info"]["prompt_tokens"]
    assert prompt > 4 * CHUNK  # the prompt really was prefilled in several chunks
    after = stats(server)
    released = after["counters"]["slots_released"] - before["counters"]["slots_released"]
    assert released == prompt - BUDGET
    assert seen, "never observed the running request after its compaction"
    for s in seen:  # mid-decode snapshots, taken between scheduler steps
        decoded = s["retained_tokens"] - BUDGET
        assert 0 <= decoded <= 120
        assert s["logical_tokens"] - s["retained_tokens"] == prompt - BUDGET  # evicted, still logical
        assert s["kv_free_slots"] == POOL - s["retained_tokens"]  # every resident row accounted
    assert len(result["output_ids"]) == 120
    assert after["kv_free_slots"] == POOL and after["running_requests"] == 0  # no leak


def test_decoding_after_compaction_stays_coherent(server):
    body = {"text": chat(FOX + "What animal jumps over the dog? Answer in one word."),
            "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    out = generate(server, body)
    assert "fox" in out["text"].lower()  # correct logical positions after compaction
    assert stats(server)["kv_free_slots"] == POOL


def test_small_pool_holds_many_more_long_requests_than_dense(server):
    prompt_len, new = 600, 48
    dense_capacity = POOL // (prompt_len + new)  # 3: what a dense pool can keep resident
    n = 8
    bodies = [{"input_ids": [1000 + (7 * i + j) % 20000 for j in range(prompt_len)],
               "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
              for i in range(n)]
    peak = peak_running(server, bodies)
    assert peak >= 2 * dense_capacity, f"peak residency {peak}"
    assert stats(server)["kv_free_slots"] == POOL


def _ids(n: int, seed: int) -> list[int]:
    return [1000 + (13 * seed + 7 * j) % 20000 for j in range(n)]


def test_arrival_counts_retained_rows_not_prompt_plus_max_new(server):
    """SGLang clips max_new_tokens at arrival so that prompt + max_new fits the pool
    (2048 - 1900 - 2 = 146 here). The MemoryOracle says the request holds BUDGET + max_new rows
    after compaction, so all 300 tokens are generated."""
    body = {"input_ids": _ids(1900, 1), "sampling_params": {"temperature": 0, "max_new_tokens": 300,
                                                            "ignore_eos": True}}
    out = generate(server, body)
    assert out["meta_info"]["completion_tokens"] == 300
    assert stats(server)["kv_free_slots"] == POOL


def test_admission_reserves_retained_rows_for_decoding(server):
    """Two requests of 1300 prompt + 400 new tokens. By SGLang's arithmetic the second can only
    start when the first ends (64 + 400 rows held or reserved by the first, 1300 + 400 needed in
    2048); by the oracle's it needs max(1300, 64 + 400) rows and runs alongside the first."""
    before = stats(server)["counters"].get("admission_rows_saved", 0)
    bodies = [{"input_ids": _ids(1300, 2 + i), "sampling_params": {"temperature": 0, "max_new_tokens": 400,
                                                                    "ignore_eos": True}}
              for i in range(2)]
    peak = peak_running(server, bodies)
    after = stats(server)
    assert peak == 2
    # each request reserved max(0, 64 + 400 - 1300) = 0 decode rows instead of 400
    assert after["counters"]["admission_rows_saved"] - before == 2 * 400
    assert after["kv_free_slots"] == POOL


def test_rows_freed_by_compaction_reopen_admission(server):
    """Seven requests of 600 + 120 tokens in 2,048 slots. Uncompacted prompts fill the pool, so
    SGLang's admission fails for memory and marks the batch full; only a finishing request would
    reopen it. Compaction frees 536 rows per request, which must reopen admission too: all seven
    run together (7 x (64 + 120) rows + one 600-token prefill fit)."""
    n = 7
    bodies = [{"input_ids": _ids(600, 20 + i), "sampling_params": {"temperature": 0, "max_new_tokens": 120,
                                                                    "ignore_eos": True}}
              for i in range(n)]
    assert peak_running(server, bodies) == n
    assert stats(server)["kv_free_slots"] == POOL
