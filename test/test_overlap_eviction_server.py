"""``--sparse-overlap on``: an evicting method (H2O, R-KV) under SGLang's overlap scheduler, on
the CPU (where SGLang runs the overlap loop too; the device wait of ``engine/inflight.py`` is a
GPU matter and is not exercised here). Against the same method without it, one server each:

- the overlap scheduler is really on (``/server_info``), and off in the other server;
- requests of mixed prompt and output lengths, some finished by a stop token (a request
  finished that way is still in the step prepared next, under overlap), one at a time, give the
  same greedy tokens and the same evictions; Chain Cache continuations resume in both and agree;
- the same requests all at once under overlap keep every snapshot's slot census clean;
- nothing leaks once the chains are gone.
"""

from __future__ import annotations

import threading

import pytest
import requests

from conftest import start_server

POOL, CHUNK, BUDGET, INTERVAL = 4096, 64, 48, 8
METHODS = {
    # --sparse-evict-prefill on (its default): also evicts between prompt chunks (CHUNK tokens)
    "h2o": ["--sparse-budget", str(BUDGET), "--sparse-recent", "12", "--sparse-interval", str(INTERVAL)],
    "rkv": ["--sparse-budget", str(BUDGET), "--sparse-window", "4", "--sparse-interval", str(INTERVAL)],
}
N = 12  # concurrent requests


@pytest.fixture(scope="module", params=sorted(METHODS))
def pair(request, default_model_dir):
    """(overlap on, overlap off) servers of one method."""
    servers = []
    for overlap in ("on", "off"):
        args = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
                "--sparse-method", request.param, *METHODS[request.param], "--sparse-overlap", overlap]
        servers.append(start_server(args, request))
    return servers


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def generate(server, prompt, n, stop=None, chain_id=None):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": stop is None}  # ignore_eos ignores stops too
    if stop is not None:
        sp["stop_token_ids"] = [stop]
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", json={"input_ids": prompt, "sampling_params": sp}, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(server):
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def concurrently(server, bodies):
    """``generate(server, *body)`` for every body at once; the results in order, and /sparse/stats
    snapshots taken while they ran."""
    out, snaps = [None] * len(bodies), []

    def one(i):
        out[i] = generate(server, *bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        snaps.append(stats(server))
    for t in threads:
        t.join()
    return out, snaps


def test_the_overlap_scheduler_is_on_only_where_asked(pair):
    on, off = (requests.get(s.base_url + "/server_info", timeout=60).json() for s in pair)
    assert on["disable_overlap_schedule"] is False and off["disable_overlap_schedule"] is True


def bodies_for(server):
    """Requests of mixed prompt and output lengths; every third one finishes on a stop token (its
    5th greedy token, found without a stop)."""
    plain = [(ids(30 + 23 * i, i), 6 + 5 * (i % 5)) for i in range(N)]
    first = generate(server, *plain[0])["output_ids"]
    return [(p, n, first[4] if i % 3 == 0 else None) for i, (p, n) in enumerate(plain)]


def test_same_tokens_and_evictions_with_and_without_overlap(pair):
    """One request at a time (the same batch shapes in both servers: greedy tokens then agree
    exactly); each still runs with a step in flight at its safe points under overlap, and one
    finished by a stop token is still in the step prepared after it."""
    bodies = bodies_for(pair[1])
    got = []
    for server in pair:
        before = stats(server)
        out = [generate(server, *b) for b in bodies]
        after = stats(server)
        evictions = after["counters"]["compactions"] - before["counters"].get("compactions", 0)
        got.append(([o["output_ids"] for o in out], [o["meta_info"]["finish_reason"]["type"] for o in out],
                    evictions, [o["meta_info"]["chain_id"] for o in out]))
    (tok_on, why_on, ev_on, chains_on), (tok_off, why_off, ev_off, chains_off) = got
    assert why_off[0] == "stop" and why_off[1] == "length"  # both ways of finishing are covered
    assert tok_on == tok_off and why_on == why_off
    assert ev_on == ev_off > N  # after each prompt over the budget and while decoding
    # a Chain Cache continuation of some of them in both servers: the same tokens again. A request
    # finished by a stop token was still in the step prepared after it under overlap: that step
    # wrote its last token's KV, which its chain keeps (one more cached token); a request finished
    # by length is left out of the next step (SGLang knows in advance), as without overlap.
    for i in range(0, N, 4):
        prompt = bodies[i][0] + tok_on[i] + ids(20, 100 + i)
        a = generate(pair[0], prompt, 9, chain_id=chains_on[i])
        b = generate(pair[1], prompt, 9, chain_id=chains_off[i])
        assert a["output_ids"] == b["output_ids"]
        extra = 1 if why_on[i] == "stop" else 0
        assert a["meta_info"]["cached_tokens"] == b["meta_info"]["cached_tokens"] + extra, (i, why_on[i])


def test_concurrent_requests_under_overlap_keep_every_row_accounted(pair):
    """The same requests all at once under overlap (batches then differ from the server without
    it, and so may CPU float rounding and greedy tokens): every snapshot's slot census is clean,
    every request is served to its end."""
    bodies = bodies_for(pair[0])
    out, snaps = concurrently(pair[0], bodies)
    assert snaps and all(s["integrity"]["ok"] for s in snaps), [s["integrity"] for s in snaps if not s["integrity"]["ok"]]
    for (prompt, n, stop), o in zip(bodies, out):
        done = o["meta_info"]
        assert done["finish_reason"]["type"] in (("length",) if stop is None else ("length", "stop"))
        if done["finish_reason"]["type"] == "length":
            assert done["completion_tokens"] == n


def test_nothing_leaks_once_the_chains_are_gone(pair):
    for server in pair:
        for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]:
            if c["status"] == "idle":
                assert requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60).status_code == 200
        s = stats(server)
        assert s["running_requests"] == 0 and s["kv_free_slots"] == POOL, s
        assert s["integrity"]["ok"], s["integrity"]
