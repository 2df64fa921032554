"""Quest with one page set per KV head (``--sparse-select-per kv_head``) through the real server
(CPU): the option reaches the method, each query head reads its KV head's ``max(3, budget/page)``
pages, the full KV stays resident and nothing leaks (the slot census after every step, on whole
pages). Which pages are chosen (the summed bounds) and what attention reads over them are checked
against plain-torch references in ``test_quest_pages.py``; the GQA kernel in
``test_sparse_kernels.py``."""

from __future__ import annotations

import pytest
import requests

from conftest import sparse_stats, start_server

PAGE, BUDGET, DENSE_LAYERS, LAYERS, HQ = 16, 64, 2, 30, 9
ARGS = ["--max-total-tokens", "4096", "--log-level", "warning", "--sparse-method", "quest",
        "--sparse-page-size", str(PAGE), "--sparse-token-budget", str(BUDGET),
        "--sparse-dense-layers", str(DENSE_LAYERS), "--sparse-select-per", "kv_head", "--dtype", "float32"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    # the slot census after every step: a running request's partly written last page is its own
    return start_server(ARGS, request, env={"SGLANG_SPARSE_CHECK_INTEGRITY": "1"})


def test_kv_head_selection_serves_reads_its_pages_and_does_not_leak(server):
    info = requests.get(server.base_url + "/sparse/info", timeout=60).json()
    assert info["config"]["method"] == "quest" and info["config"]["options"]["select_per"] == "kv_head"
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    before = sparse_stats(server)
    assert before["kv_free_slots"] == before["kv_total_slots"]
    prompt = list(range(1000, 1000 + 300))
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
    out = requests.post(server.base_url + "/generate", json=body, timeout=300).json()
    assert len(out["output_ids"]) == 4  # 1 token from prefill, 3 decode steps over 301..303 tokens
    after = sparse_stats(server)
    heads = (LAYERS - DENSE_LAYERS) * HQ
    n_sel = max(3, BUDGET // PAGE)
    c0, c1 = before["counters"], after["counters"]
    assert c1["pages_total"] - c0.get("pages_total", 0) == heads * sum(-(-n // PAGE) for n in (301, 302, 303))
    assert c1["pages_selected"] - c0.get("pages_selected", 0) == heads * 3 * n_sel
    assert c1["slots_released"] == 0 and after["running_requests"] == 0
    assert c1["integrity_violations"] == 0  # 16-slot pages, every step (prefill and 3 decodes)
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    flushed = sparse_stats(server)
    assert flushed["kv_free_slots"] == flushed["kv_total_slots"]


def test_kv_head_answers_like_dense_when_the_budget_covers_everything(server):
    body = {"text": "The capital of France is", "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    out = requests.post(server.base_url + "/generate", json=body, timeout=300).json()
    assert out["text"].startswith(" Paris")
