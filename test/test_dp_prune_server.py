"""``/prune`` under data parallelism (``--dp-size 2`` on the CPU, dense, one radix tree per rank):
the job is planned on every rank that caches the prefix, under one id, its probe is routed to
each of them, and the mask is applied there; a rank without the prefix is left out. Without the
routing, a probe balanced to the other rank finds no job and the prune fails."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import start_server

pytestmark = pytest.mark.whole_machine  # binds its ranks' threads to cores 0 and 1 itself: run alone

POOL = 4096
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--log-level", "warning", "--dp-size", "2"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    env = {**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    return start_server(ARGS, request, env=env, timeout=600)


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def gen(server, prompt, rank):
    body = {"input_ids": prompt, "routed_dp_rank": rank,
            "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    r = requests.post(server.base_url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()


def free_slots(server) -> list[int]:
    s = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    return [r["kv_free_slots"] for r in s["per_rank"]]


def prune(server, prompt, left, right, keep):
    r = requests.post(server.base_url + "/prune", timeout=600, json={
        "token_ids": prompt, "ranges": [[left, right]], "keep_tokens": keep, "policy": "kvzip", "wait": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prefix_cached_on_one_rank_is_pruned_there(server):
    prompt = ids(300, 1)
    gen(server, prompt, 1)
    for i, (left, right) in enumerate(((20, 100), (120, 200), (220, 280))):  # three probes in a row
        before = free_slots(server)
        rec = prune(server, prompt, left, right, 10)
        assert rec["status"] == "completed" and rec["dp_ranks"] == [1], rec
        assert rec["freed_slots"] == right - left - 10
        after = free_slots(server)
        assert (after[0] - before[0], after[1] - before[1]) == (0, right - left - 10)


def test_a_prefix_cached_on_both_ranks_is_pruned_on_both(server):
    prompt = ids(300, 2)
    for rank in (0, 1):
        gen(server, prompt, rank)
    before = free_slots(server)
    rec = prune(server, prompt, 40, 200, 20)
    assert rec["status"] == "completed" and rec["dp_ranks"] == [0, 1], rec
    assert [r["freed_slots"] for r in rec["per_rank"]] == [140, 140] and rec["freed_slots"] == 280
    after = free_slots(server)
    assert [a - b for a, b in zip(after, before)] == [140, 140]
    # the pruned prefix still matches in full on each rank
    for rank in (0, 1):
        assert gen(server, prompt, rank)["meta_info"]["cached_tokens"] == 299


def test_a_prefix_cached_nowhere_gets_404(server):
    r = requests.post(server.base_url + "/prune", timeout=60, json={
        "token_ids": ids(300, 3), "ranges": [[0, 100]], "keep_tokens": 10})
    assert r.status_code == 404 and "not cached that far" in r.text, r.text
