"""Two sglang_sparse replicas (SnapKV, Chain Cache, ``--chain-replica a`` / ``b``) behind
``sglang-router --policy manual``: an agent session's requests carry ``X-SMG-Routing-Key``, the
router pins the key to one replica and that replica continues the key's chain (``key-<K>``), so
every continuation resumes; a chain id of one replica sent to the other gets 404 naming the
replica that started it; a bad routing key gets 400 naming the header; and when a replica is
killed, its sessions' next requests are retried by the client and finish on the other replica
(a full prefill there), none lost. Slot census clean on the survivor.

Each replica's threads are bound to one core (``SGLANG_CPU_OMP_THREADS_BIND``)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
pytest.importorskip("sglang_router", reason="sglang-router is a test dependency (pip install -e '.[test]')")

import bench_replicas as R  # noqa: E402

from sglang_sparse.server_process import ServerProcess  # noqa: E402

pytestmark = pytest.mark.whole_machine  # binds its replicas' threads to cores 0 and 1 itself: run alone

FLAGS = ["--max-total-tokens", "4096", "--chunked-prefill-size", "256", "--log-level", "warning",
         "--sparse-method", "snapkv", "--sparse-budget", "64", "--sparse-window", "8"]


@pytest.fixture(scope="module")
def cluster(request):
    servers = [ServerProcess(FLAGS + ["--chain-replica", name], env=R.cpu_env(str(i % (os.cpu_count() or 1))))
               for i, name in enumerate("ab")]
    for srv in servers:
        request.addfinalizer(srv.stop)
    R.start_servers(servers, timeout=600)
    router = R.Router([s.base_url for s in servers], "manual", "/tmp/test_replicas_router.log")
    router.__enter__()
    request.addfinalizer(router.__exit__)
    return SimpleNamespace(a=servers[0], b=servers[1], router=router)


def replay_args(**kw):
    base = dict(replicas=2, sessions=4, turns=3, system=200, answer=8, tool_output=48, tool_wait=0.0,
                kill_after=0, on_kill=None)
    return SimpleNamespace(**{**base, **kw})


def chains_of(server) -> list[str]:
    return [c["chain_id"] for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]]


def test_every_continuation_reaches_its_chain_through_the_router(cluster):
    out = R.replay(cluster.router.url, replay_args(), "header")
    assert out["failed"] == 0 and out["retried"] == 0, out
    assert out["continuations"] == 8 and out["resumed"] == 8 and out["missed"] == 0, out["miss_messages"]
    on_a, on_b = set(chains_of(cluster.a)), set(chains_of(cluster.b))
    keyed = {f"key-session-{s}" for s in range(4)}
    assert keyed <= on_a | on_b and not (keyed & on_a & on_b)  # each session's chain on one replica
    for srv in (cluster.a, cluster.b):
        stats = requests.get(srv.base_url + "/sparse/stats", timeout=60).json()
        assert stats["integrity"]["ok"], stats["integrity"]


def test_a_chain_of_the_other_replica_is_refused_with_a_sentence(cluster):
    body = {"input_ids": list(range(100, 160)), "sampling_params": {"max_new_tokens": 2}}
    first = requests.post(cluster.b.base_url + "/generate", json=body, timeout=120).json()
    chain = first["meta_info"]["chain_id"]
    assert chain.startswith("chain-b-")
    cont = {**body, "input_ids": body["input_ids"] + first["output_ids"] + [7, 8, 9], "chain_id": chain}
    resp = requests.post(cluster.a.base_url + "/generate", json=cont, timeout=120)
    assert resp.status_code == 404
    assert "started on replica b and this is replica a" in resp.text
    resp = requests.post(cluster.b.base_url + "/generate", json=cont, timeout=120)  # untouched on b
    assert resp.status_code == 200 and resp.json()["meta_info"]["chain_status"] == "resumed"


def test_a_bad_routing_key_is_a_400_naming_the_header(cluster):
    for url in (cluster.a.base_url, cluster.router.url):
        resp = requests.post(url + "/generate", headers={"X-SMG-Routing-Key": "x" * 200},
                             json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert resp.status_code == 400 and "X-SMG-Routing-Key" in resp.text, resp.text
    for bad in ("two words", "", "caf\u00e9"):  # spaces, empty, non-ASCII: straight to the replica
        resp = requests.post(cluster.a.base_url + "/generate", headers={"X-SMG-Routing-Key": bad.encode()},
                             json={"text": "hi", "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert resp.status_code == 400 and "X-SMG-Routing-Key" in resp.text, (bad, resp.text)
    assert requests.get(cluster.a.base_url + "/health", timeout=60).status_code == 200


def test_a_busy_keys_second_request_runs_on_a_chain_of_its_own(cluster):
    """Two requests of one key at once: one takes the key's chain, the other a plain chain."""
    body = {"input_ids": [400 + j for j in range(60)],
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}  # overlap
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: requests.post(cluster.a.base_url + "/generate", json=body, timeout=300,
                                                     headers={"X-SMG-Routing-Key": "busy-key"}), range(2)))
    assert [r.status_code for r in outs] == [200, 200], [r.text for r in outs]
    ids = sorted(r.json()["meta_info"]["chain_id"] for r in outs)
    assert ids[0].startswith("chain-a-") and ids[1] == "key-busy-key", ids


def test_a_killed_replica_loses_no_request(cluster):
    """A key the router pinned to b; b is killed; the key's next request is retried (the
    router's 5xx for a dead worker, counted) and finishes on a as a new chain; a replay after
    that loses nothing and resumes every continuation."""
    held_by_b = None
    for i in range(32):  # the router places a new key; find one it put on b
        body = {"input_ids": [300 + i] * 40, "sampling_params": {"max_new_tokens": 2}}
        resp = requests.post(cluster.router.url + "/generate", headers={"X-SMG-Routing-Key": f"probe-{i}"},
                             json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        if f"key-probe-{i}" in chains_of(cluster.b):
            held_by_b = (i, body["input_ids"] + resp.json()["output_ids"])
            break
    assert held_by_b is not None, "the router placed 32 new keys, none on replica b"
    os.killpg(cluster.b.proc.pid, signal.SIGKILL)
    i, ids = held_by_b
    counts = {"retried": 0, "retry_reasons": []}
    status, out = R.post(cluster.router.url, {"input_ids": ids + [5, 6, 7], "sampling_params": {"max_new_tokens": 2}},
                         {"X-SMG-Routing-Key": f"probe-{i}"}, counts, threading.Lock(), tries=10)
    assert status == 200, (out, counts)
    assert out["meta_info"]["chain_status"] == "created" and f"key-probe-{i}" in chains_of(cluster.a)
    replay = R.replay(cluster.router.url, replay_args(sessions=4, turns=2), "header")
    assert replay["failed"] == 0 and replay["requests"] == 8, replay["fail_reasons"]
    assert replay["resumed"] == replay["continuations"] == 4, replay["miss_messages"]
    stats = requests.get(cluster.a.base_url + "/sparse/stats", timeout=60).json()
    assert stats["integrity"]["ok"], stats["integrity"]


def test_openai_requests_with_a_routing_key_continue_the_keys_chain(cluster):
    """OpenAI ``/v1/completions`` through the router: the header names the chain there too, and
    ``usage`` carries the chain fields (one output token: the chain's boundary is the prompt)."""
    model = requests.get(cluster.a.base_url + "/v1/models", timeout=60).json()["data"][0]["id"]
    # the router takes text prompts only; the second prompt's tokens extend the first's (a word
    # boundary: the first ends with ".", the suffix starts with " ")
    prompt = " ".join(["The tool returned the following rows."] * 12)

    def complete(text):
        resp = requests.post(cluster.router.url + "/v1/completions", headers={"X-SMG-Routing-Key": "openai-agent"},
                             json={"model": model, "prompt": text, "max_tokens": 1, "temperature": 0}, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()["usage"]

    first = complete(prompt)
    assert (first["chain_id"], first["chain_status"]) == ("key-openai-agent", "created"), first
    second = complete(prompt + " Next, summarise them.")
    assert (second["chain_id"], second["chain_status"], second["reused_tokens"]) == \
        ("key-openai-agent", "resumed", first["prompt_tokens"]), second
