"""H2O and R-KV through the real server (CPU), one server per method: every eviction (after the
prompt, then every ``interval`` decode rows) frees exactly the rows over the budget to SGLang's
allocator, ``/sparse/stats`` counts evictions and rows released, a Chain Cache continuation
resumes the parked rows and scores and prefills only its suffix, nothing leaks once the chains
are gone, and a bad flag stops the launcher with a sentence."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import start_server

POOL, CHUNK, BUDGET, INTERVAL = 512, 64, 48, 8
METHODS = {
    "h2o": ["--sparse-budget", str(BUDGET), "--sparse-recent", "12", "--sparse-interval", str(INTERVAL)],
    "rkv": ["--sparse-budget", str(BUDGET), "--sparse-window", "4", "--sparse-interval", str(INTERVAL)],
}


@pytest.fixture(scope="module", params=sorted(METHODS))
def server(request, default_model_dir):
    args = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
            "--sparse-method", request.param, *METHODS[request.param]]  # --chain-cache auto: on
    return start_server(args, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def gen(server, prompt, n, chain_id=None) -> dict:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", json={"input_ids": prompt, "sampling_params": sp},
                         timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chain(server, chain_id) -> dict:
    return requests.get(f"{server.base_url}/chain/{chain_id}", timeout=60).json()


def delta(after, before, key):
    return after["counters"].get(key, 0) - before["counters"].get(key, 0)


def test_every_eviction_frees_exactly_the_rows_over_the_budget(server):
    before = stats(server)
    prompt, new = 160, 20  # 19 decode forwards write KV: evictions after 8 and 16 of them
    body = {"input_ids": ids(prompt, 1), "sampling_params": {"temperature": 0, "max_new_tokens": new,
                                                               "ignore_eos": True}}
    out, seen = {}, []
    worker = threading.Thread(target=lambda: out.update(resp=requests.post(
        server.base_url + "/generate", json=body, timeout=600)))
    worker.start()
    while worker.is_alive():
        s = stats(server)
        if s["running_requests"] == 1:
            seen.append(s)
        time.sleep(0.3)
    worker.join()
    assert out["resp"].status_code == 200, out["resp"].text
    o = out["resp"].json()
    assert o["meta_info"]["completion_tokens"] == new
    after = stats(server)
    decode_evictions = (new - 1) // INTERVAL
    released = (prompt - BUDGET) + decode_evictions * INTERVAL
    assert delta(after, before, "compactions") == delta(after, before, "evictions") == 1 + decode_evictions
    assert delta(after, before, "slots_released") == delta(after, before, "rows_released") == released
    kept = BUDGET + (new - 1) % INTERVAL  # rows the chain parks
    rec = chain(server, o["meta_info"]["chain_id"])
    assert (rec["processed_tokens"], rec["retained_rows"]) == (prompt + new - 1, kept)
    assert after["kv_free_slots"] == before["kv_free_slots"] - kept  # freed exactly what was evicted
    assert seen, "never observed the running request"
    for s in seen:  # snapshots between scheduler steps: every resident row accounted, census clean
        assert s["kv_free_slots"] + s["retained_tokens"] == POOL, s
        assert s["integrity"]["ok"], s["integrity"]
        if s["logical_tokens"] - s["retained_tokens"] > before["logical_tokens"] - before["retained_tokens"]:
            assert s["retained_tokens"] - before["retained_tokens"] <= BUDGET + INTERVAL  # evicted: bounded


def test_chain_continuation_resumes_and_prefills_only_its_suffix(server):
    before = stats(server)
    p1 = ids(100, 2)
    o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    assert chain(server, cid)["retained_rows"] == BUDGET + 3
    p2 = p1 + o1["output_ids"] + ids(20, 3)
    o2 = gen(server, p2, 4, cid)
    m2 = o2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"], m2["reused_tokens"]) == (cid, "resumed", 103)
    assert m2["cached_tokens"] == 103  # SGLang prefilled only the 21-token suffix
    after = stats(server)
    # turn 2 evicted its 51 resumed rows + 21 new ones back to the budget, from the parked scores
    assert delta(after, before, "evictions") == 2
    assert delta(after, before, "rows_released") == (100 - BUDGET) + (BUDGET + 3 + 21 - BUDGET)
    rec = chain(server, cid)
    assert (rec["status"], rec["processed_tokens"], rec["retained_rows"]) == ("idle", 127, BUDGET + 3)


def test_nothing_leaks_once_the_chains_are_gone(server):
    for c in [c for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"] if c["status"] == "idle"]:
        assert requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60).status_code == 200
    s = stats(server)
    assert s["running_requests"] == 0 and s["kv_free_slots"] == POOL, s
    assert s["integrity"]["ok"], s["integrity"]


@pytest.mark.parametrize("flags,message", [
    (["--sparse-method", "h2o", "--sparse-budget", "16", "--sparse-recent", "16"],
     "budget=16 is out of range: must be > recent=16"),
    (["--sparse-method", "rkv", "--sparse-alpha", "2"], "alpha=2.0 is out of range: must be in [0, 1]"),
])
def test_a_bad_flag_is_refused_at_start(request, flags, message):
    from sglang_sparse.server_process import ServerStartError

    with pytest.raises(ServerStartError) as err:
        start_server(flags, request, timeout=120)
    assert f"sglang_sparse: error: {message}" in str(err.value)
