"""OmniKV through the real server (CPU, torch_native backend): the full KV stays resident, every
decode step selects at each filter layer and the other sparse layers read exactly the chosen
prompt tokens plus the generated ones, a radix-cached prefix gives the cold answer, a prompt
within the budget answers like dense, nothing leaks."""

from __future__ import annotations

import pytest
import requests

from conftest import greedy, sparse_stats, start_server

BUDGET, FILTERS, LAYERS = 64, (2, 8, 18), 30
ARGS = ["--max-total-tokens", "8192", "--log-level", "warning", "--sparse-method", "omnikv",
        "--sparse-token-budget", str(BUDGET), "--sparse-filter-layers", ",".join(map(str, FILTERS)),
        "--dtype", "float32"]
# layers that read the selection: after the first filter layer, except the filter layers
SPARSE_LAYERS = LAYERS - FILTERS[0] - len(FILTERS)


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_reads_the_selection_plus_generated_tokens_keeps_everything_and_does_not_leak(server):
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    before = sparse_stats(server)
    assert before["method"] == "omnikv" and before["kv_free_slots"] == before["kv_total_slots"]
    prompt = [1000 + (7 * j) % 20000 for j in range(300)]
    out = greedy(server, prompt, 4)  # token 1 from prefill (dense), then 3 decode steps
    assert len(out["output_ids"]) == 4
    c0, c1 = before["counters"], sparse_stats(server)["counters"]
    delta = lambda name: c1.get(name, 0) - c0.get(name, 0)  # noqa: E731
    assert delta("filter_selections") == 3 * len(FILTERS)
    # decode step t (1..3) over 300 + t rows: BUDGET prompt rows and t generated rows per layer
    assert delta("rows_read") == SPARSE_LAYERS * sum(BUDGET + t for t in (1, 2, 3))
    assert delta("rows_resident") == SPARSE_LAYERS * sum(300 + t for t in (1, 2, 3))
    assert c1.get("slots_released", 0) == 0  # selection is logical: nothing is evicted
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    flushed = sparse_stats(server)
    assert flushed["kv_free_slots"] == flushed["kv_total_slots"] and flushed["integrity"]["ok"]


def test_a_prompt_within_the_budget_answers_like_dense(server):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    out = requests.post(server.base_url + "/generate", json=body, timeout=300).json()
    assert out["text"].startswith(" Paris")


def test_a_radix_cached_prefix_gives_the_cold_answer(server):
    """The selection reads the request's resident rows, cached or not: a prompt whose prefix comes
    from the radix cache selects from the same keys and answers as when it was prefilled cold."""
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    prefix = [2000 + (11 * j) % 9000 for j in range(400)]
    prompt = prefix + list(range(500, 540))
    cold = greedy(server, prompt, 8)
    assert cold["meta_info"]["cached_tokens"] == 0
    requests.post(server.base_url + "/flush_cache", timeout=60)
    greedy(server, prefix + list(range(700, 720)), 1)  # puts the prefix in the radix tree
    warm = greedy(server, prompt, 8)
    assert warm["meta_info"]["cached_tokens"] >= 400
    assert warm["output_ids"] == cold["output_ids"]
