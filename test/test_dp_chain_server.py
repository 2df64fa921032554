"""Chain Cache under data parallelism (``--dp-size 2`` on the CPU, SnapKV, one scheduler per rank):
chain ids carry their rank (``chain-r<k>-<n>``, unique across ranks), every continuation reaches
the rank that holds its chain (SGLang's ``routed_dp_rank``, set from the id) and resumes it, a
continuation sent to the other rank by hand finds nothing there (what routing prevents), and
``GET /chain``, ``GET /chain/{id}``, ``DELETE /chain/{id}`` and ``/sparse/stats`` cover both ranks.

SGLang 0.5.23 binds each CPU rank's threads to a NUMA node unless ``SGLANG_CPU_OMP_THREADS_BIND``
names the cores per rank; the test gives each rank one core (``0|1``)."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import start_server

pytestmark = pytest.mark.whole_machine  # binds its ranks' threads to cores 0 and 1 itself: run alone

BUDGET, POOL = 64, 4096
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--log-level", "warning",
        "--sparse-method", "snapkv", "--sparse-budget", str(BUDGET), "--sparse-window", "8", "--dp-size", "2"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    env = {**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    return start_server(ARGS, request, env=env, timeout=600)


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def gen(server, prompt, n, chain_id=None, rank=None):
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if chain_id is not None:
        body["chain_id"] = chain_id
    if rank is not None:
        body["routed_dp_rank"] = rank
    r = requests.post(server.base_url + "/generate", json=body, timeout=600)
    return r.status_code, r.json()


def test_every_continuation_reaches_its_chain_on_either_rank(server):
    sessions = {}
    for s in range(4):  # new chains spread over the ranks by SGLang's own DP balancing
        prompt = ids(200 + 10 * s, s)
        code, out = gen(server, prompt, 4)
        assert code == 200, out
        m = out["meta_info"]
        assert m["chain_status"] == "created" and m["chain_id"].startswith("chain-r"), m
        sessions[m["chain_id"]] = prompt + out["output_ids"]
    ranks = {cid.split("-")[1] for cid in sessions}
    assert ranks == {"r0", "r1"}, sessions.keys()  # both ranks hold chains
    for turn in range(2):
        # the same rank's chains back to back: a balancer that alternates ranks (SGLang's round
        # robin, which would happen to match creation order) sends one of each pair astray
        for cid in sorted(sessions):
            prompt = sessions[cid] + ids(20, 100 + turn)
            code, out = gen(server, prompt, 4, cid)
            assert code == 200, out
            m = out["meta_info"]
            assert (m["chain_id"], m["chain_status"]) == (cid, "resumed"), m
            assert m["reused_tokens"] == len(sessions[cid]) - 1  # the last output token had no KV
            sessions[cid] = prompt + out["output_ids"]
    listed = {c["chain_id"] for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]}
    assert set(sessions) <= listed
    stats = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    assert len(stats["per_rank"]) == 2
    for rank in stats["per_rank"]:  # every slot free or held by an idle chain, on each rank
        assert rank["running_requests"] == 0
        assert rank["kv_free_slots"] + rank["chain_idle_rows"] == rank["kv_total_slots"], rank
        assert rank["integrity"]["ok"], rank["integrity"]


def test_a_routing_keys_chain_lives_on_the_rank_its_key_hashes_to(server):
    """``X-SMG-Routing-Key`` (sglang-router's header) names a chain ``key-<K>``; under DP every
    request of a key goes to rank crc32(K) % 2, so its continuations resume."""
    keys = ("agent-1", "agent-2", "agent-4")  # ranks 1, 1, 0
    prompts = {key: ids(120, n) for n, key in enumerate(keys)}
    for turn in range(3):
        for key in keys:
            body = {"input_ids": prompts[key],
                    "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
            r = requests.post(server.base_url + "/generate", json=body, headers={"X-SMG-Routing-Key": key}, timeout=600)
            assert r.status_code == 200, r.text
            m = r.json()["meta_info"]
            assert (m["chain_id"], m["chain_status"]) == (f"key-{key}", "resumed" if turn else "created"), m
            prompts[key] = prompts[key] + r.json()["output_ids"] + ids(10, turn)


def test_a_sessions_turns_stay_on_one_rank_and_resume_its_chain(server):
    """SGLang opens a session on every rank; its requests go to the rank the id hashes to, so
    each turn extends the session's chain there (``session-<id>``)."""
    for n in range(2):
        sid = requests.post(server.base_url + "/open_session", json={"capacity_of_str_len": 4096}, timeout=60).json()
        prompt, prev = ids(100, 50 + n), None
        for turn in range(3):
            body = {"input_ids": prompt, "session_params": {"id": sid, **({"rid": prev} if prev else {})},
                    "sampling_params": {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}}
            r = requests.post(server.base_url + "/generate", json=body, timeout=600)
            assert r.status_code == 200, r.text
            m = r.json()["meta_info"]
            assert (m["chain_id"], m["chain_status"]) == (f"session-{sid}", "resumed" if turn else "created"), m
            prompt, prev = ids(10, 60 + turn), m["id"]  # a session request sends only the new tokens
        requests.post(server.base_url + "/close_session", json={"session_id": sid}, timeout=60)


def test_the_wrong_rank_does_not_know_the_chain_and_admin_routes_cover_both(server):
    code, out = gen(server, ids(150, 7), 4, rank=1)  # pinned to rank 1 by the client
    assert code == 200, out
    cid = out["meta_info"]["chain_id"]
    assert cid.startswith("chain-r1-"), cid
    history = ids(150, 7) + out["output_ids"]
    code, wrong = gen(server, history + ids(10, 8), 4, cid, rank=0)  # sent by hand to the other rank
    assert code == 404, wrong
    rec = requests.get(f"{server.base_url}/chain/{cid}", timeout=60)
    assert rec.status_code == 200 and rec.json()["status"] == "idle", rec.text  # untouched on rank 1
    code, right = gen(server, history + ids(10, 8), 4, cid)  # routed by its id
    assert code == 200 and right["meta_info"]["chain_status"] == "resumed", right
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 200
    assert requests.get(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 404
    assert requests.delete(f"{server.base_url}/chain/chain-r1-999", timeout=60).status_code == 404
    integrity = requests.get(server.base_url + "/chain", timeout=60).json()["integrity"]
    assert integrity["ok"] and len(integrity["per_rank"]) == 2, integrity
