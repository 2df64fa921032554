"""Quest through the real server (CPU, torch_native backend): full KV stays resident, attention
reads only the selected pages in non-dense layers, the radix cache keeps working (a cached prefix
is summarised on the fly and gives the same answer), nothing leaks."""

from __future__ import annotations

import pytest
import requests

from conftest import greedy, sparse_stats, start_server

PAGE, BUDGET, DENSE_LAYERS, LAYERS, HQ = 16, 64, 2, 30, 9
ARGS = ["--max-total-tokens", "8192", "--log-level", "warning", "--sparse-method", "quest",
        "--sparse-page-size", str(PAGE), "--sparse-token-budget", str(BUDGET),
        "--sparse-dense-layers", str(DENSE_LAYERS), "--dtype", "float32"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def test_quest_reads_selected_pages_keeps_everything_and_does_not_leak(server):
    # SGLang's start-up warm-up request left its KV in the radix tree
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    before = sparse_stats(server)
    assert before["method"] == "quest" and before["kv_free_slots"] == before["kv_total_slots"]
    prompt = list(range(1000, 1000 + 300))  # 300 tokens: 19 pages at the decode step
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}}
    out = requests.post(server.base_url + "/generate", json=body, timeout=300).json()
    assert len(out["output_ids"]) == 2  # token 1 from prefill (dense), token 2 from one decode step
    after = sparse_stats(server)
    # One decode step over 301 tokens: ceil(301/16) = 19 pages, of which each query head of each
    # non-dense layer reads max(3, 64 // 16) = 4. Dense layers are not counted at all.
    n_pages, n_sel = -(-301 // PAGE), max(3, BUDGET // PAGE)
    heads = (LAYERS - DENSE_LAYERS) * HQ
    c0, c1 = before["counters"], after["counters"]
    assert c1.get("pages_total", 0) - c0.get("pages_total", 0) == heads * n_pages
    assert c1.get("pages_selected", 0) - c0.get("pages_selected", 0) == heads * n_sel
    assert c1["slots_released"] == 0  # selection is logical: nothing is evicted
    assert after["running_requests"] == 0
    # The finished request's KV is now radix-cached; flushing gives every slot back.
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    flushed = sparse_stats(server)
    assert flushed["kv_free_slots"] == flushed["kv_total_slots"]


def test_quest_answers_like_dense_when_the_budget_covers_everything(server):
    """A 20-token prompt has 2 pages, below the 4-page budget: Quest reads every page, so the
    answer is the dense one (checked against the known dense greedy continuation)."""
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    out = requests.post(server.base_url + "/generate", json=body, timeout=300).json()
    assert out["text"].startswith(" Paris")


def test_radix_cached_prefix_gives_the_same_selection_and_answer(server):
    """Quest keeps page summaries per request. A request whose prefix comes from the radix cache
    summarises the cached keys when it starts, so it reads the same pages and answers the same
    as when its whole prompt was prefilled."""
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    prefix = [2000 + (11 * j) % 9000 for j in range(400)]
    prompt = prefix + list(range(500, 540))
    c0 = sparse_stats(server)["counters"].get("pages_selected", 0)
    cold = greedy(server, prompt, 8)
    assert cold["meta_info"]["cached_tokens"] == 0
    cold_pages = sparse_stats(server)["counters"]["pages_selected"] - c0
    requests.post(server.base_url + "/flush_cache", timeout=60)
    greedy(server, prefix + list(range(700, 720)), 1)  # puts the prefix in the radix tree
    c1 = sparse_stats(server)["counters"]["pages_selected"]
    warm = greedy(server, prompt, 8)
    assert warm["meta_info"]["cached_tokens"] >= len(prefix)
    assert warm["output_ids"] == cold["output_ids"]
    # the warm run read as many pages as the cold one (same lengths, same budget): the cached
    # prefix was summarised, not skipped
    assert sparse_stats(server)["counters"]["pages_selected"] - c1 == cold_pages > 0


def test_pruned_prefix_keeps_whole_pages_and_still_serves(server):
    """/prune on Quest: intervals and the keep mask are whole 16-token pages (Quest's page
    summaries stay valid for the pages kept); the pruned path still matches and decodes."""
    prompt = [3000 + (13 * j) % 9000 for j in range(400)]
    greedy(server, prompt, 1)
    url = server.base_url
    unaligned = requests.post(url + "/prune", timeout=600, json={
        "token_ids": prompt, "ranges": [[30, 256]], "keep_ratio": 0.25, "wait": True})
    assert unaligned.status_code == 400 and "page size 16" in unaligned.text
    free = sparse_stats(server)["kv_free_slots"]
    rec = requests.post(url + "/prune", timeout=600, json={
        "token_ids": prompt, "ranges": [[32, 256]], "keep_ratio": 0.25, "wait": True}).json()
    # floor(0.25 * 224) = 56 tokens, rounded down to 3 pages
    assert (rec["status"], rec["retained_tokens"], rec["freed_slots"]) == ("completed", 48, 176), rec
    assert sparse_stats(server)["kv_free_slots"] - free == 176
    out = greedy(server, prompt + list(range(800, 810)), 4)
    assert out["meta_info"]["cached_tokens"] >= 384
    s = sparse_stats(server)
    assert s["integrity"]["ok"], s["integrity"]
