"""H2O and R-KV through the real server (CPU), one server per method: every eviction (H2O:
between prompt chunks too, ``--sparse-evict-prefill on``, its default; then after the prompt,
then every ``interval`` decode rows) frees exactly the rows over the budget to SGLang's
allocator, ``/sparse/stats`` counts evictions and rows released, a Chain Cache continuation
resumes the parked rows and scores and prefills only its suffix, nothing leaks once the chains
are gone, and a bad flag stops the launcher with a sentence. The pool (2048 slots) takes prompts
longer than 512 tokens (SGLang refuses a prompt longer than its pool); H2O holds at most
budget + interval + chunk rows of one at a time."""

from __future__ import annotations


import pytest
import requests

from conftest import start_server, watch

POOL, CHUNK, BUDGET, INTERVAL = 2048, 64, 48, 8
METHODS = {
    "h2o": ["--sparse-budget", str(BUDGET), "--sparse-recent", "12", "--sparse-interval", str(INTERVAL)],
    "rkv": ["--sparse-budget", str(BUDGET), "--sparse-window", "4", "--sparse-interval", str(INTERVAL)],
}


@pytest.fixture(scope="module", params=sorted(METHODS))
def server(request, default_model_dir):
    args = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
            "--sparse-method", request.param, *METHODS[request.param]]  # --chain-cache auto: on
    srv = start_server(args, request)
    srv.method = request.param
    return srv


def prompt_evictions(method, rows, new, last=True):
    """Evictions while prefilling ``new`` prompt tokens in CHUNK-token chunks after ``rows``
    resident rows (the engine's trigger, ``EvictingRuntime.schedule_over_budget``): H2O evicts
    after any chunk that leaves it INTERVAL or more rows past the budget, and after the last one
    when over the budget at all; R-KV only after the last chunk. Returns (evictions, rows left)."""
    count = 0
    while new:
        take = min(CHUNK, new)
        rows, new = rows + take, new - take
        over = rows - BUDGET
        if over > 0 and ((last and not new) or (method == "h2o" and over >= INTERVAL)):
            count, rows = count + 1, BUDGET
    return count, rows


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
    o, seen = watch(server, body, poll=0.3)
    assert o["meta_info"]["completion_tokens"] == new
    after = stats(server)
    decode_evictions = (new - 1) // INTERVAL
    released = (prompt - BUDGET) + decode_evictions * INTERVAL
    during_prompt = prompt_evictions(server.method, 0, prompt)[0]  # h2o: 3 (after each of its 3 chunks)
    assert during_prompt == (3 if server.method == "h2o" else 1)
    assert delta(after, before, "compactions") == delta(after, before, "evictions") == during_prompt + decode_evictions
    assert delta(after, before, "slots_released") == delta(after, before, "rows_released") == released
    # what the compactions cost is reported (host wall time), apart from the event counters
    assert after["timings_us"]["compaction"] > before["timings_us"].get("compaction", 0)
    assert "compaction" not in after["counters"]
    # the decode-time evictions apart from the prompt's (prompt compression, between chunks)
    assert delta(after, before, "decode_compactions") == decode_evictions
    decode_us = after["timings_us"]["compaction_decode"] - before["timings_us"].get("compaction_decode", 0)
    assert 0 < decode_us <= after["timings_us"]["compaction"] - before["timings_us"].get("compaction", 0)
    kept = BUDGET + (new - 1) % INTERVAL  # rows the chain parks
    rec = chain(server, o["meta_info"]["chain_id"])
    assert (rec["processed_tokens"], rec["retained_rows"]) == (prompt + new - 1, kept)
    assert after["kv_free_slots"] == before["kv_free_slots"] - kept  # freed exactly what was evicted
    assert seen, "never observed the running request"
    for s in seen:  # snapshots between scheduler steps: every resident row accounted, census clean
        assert s["kv_free_slots"] + s["retained_tokens"] == POOL, s
        assert s["integrity"]["ok"], s["integrity"]
        if s["logical_tokens"] - s["retained_tokens"] > before["logical_tokens"] - before["retained_tokens"]:
            decoding = s["logical_tokens"] - before["logical_tokens"] > prompt
            bound = BUDGET + INTERVAL + (0 if decoding else CHUNK)  # h2o evicts between prompt chunks
            assert s["retained_tokens"] - before["retained_tokens"] <= bound  # evicted: bounded


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
    # turn 1: its prompt's chunks (h2o: after chunk 1 of 64 rows too); turn 2 evicted its 51
    # resumed rows + 21 new ones back to the budget, from the parked scores
    assert delta(after, before, "evictions") == prompt_evictions(server.method, 0, 100)[0] + 1
    assert delta(after, before, "rows_released") == (100 - BUDGET) + (BUDGET + 3 + 21 - BUDGET)
    rec = chain(server, cid)
    assert (rec["status"], rec["processed_tokens"], rec["retained_rows"]) == ("idle", 127, BUDGET + 3)


def test_retention_map_of_a_chain_shows_the_rows_each_head_kept(server):
    """``GET /chain/{id}/retention``: per layer and KV head exactly the parked rows, as logical
    positions; the rows decoded after the last eviction and the always-kept recent rows of that
    eviction in every head (H2O: its recent window; R-KV: its query buffer's rows); heavy hitters
    chosen per head, so the heads of a layer differ."""
    o = gen(server, ids(100, 4), 4)
    cid = o["meta_info"]["chain_id"]
    rec = chain(server, cid)
    resp = requests.get(f"{server.base_url}/chain/{cid}/retention", params={"format": "positions"}, timeout=60)
    assert resp.status_code == 200, resp.text
    r = resp.json()
    assert (r["method"], r["logical_len"], r["retained_rows"]) == (server.method, 103, rec["retained_rows"])
    recent = 12 if server.method == "h2o" else 4  # --sparse-recent / --sparse-window
    always = set(range(100 - recent, 103))  # the prompt's last rows at its eviction + 3 decoded
    assert len(r["layers"]) == r["num_layers"] > 0
    for layer in r["layers"]:
        assert len(layer["heads"]) == r["kv_heads"]
        for head in layer["heads"]:
            pos = head["positions"]
            assert len(pos) == BUDGET + 3 and pos == sorted(set(pos)) and pos[-1] < 103
            assert always <= set(pos)
    assert any(len({str(h["positions"]) for h in layer["heads"]}) > 1 for layer in r["layers"])
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)


LONG = 512  # 8 chunks of 64 (1.5K works the same, 24 chunks, but takes minutes on a shared CPU)


def test_h2o_evicts_between_prompt_chunks_of_a_long_prompt(server):
    """A prompt of 8 chunks: H2O evicts between them (counted while the request is
    still prefilling), never holds more than budget + interval + chunk rows, frees exactly the
    rows over the budget, its greedy tokens are deterministic, and a chain continuation prefills
    only its suffix (2 chunks after 517 compacted logical tokens)."""
    if server.method != "h2o":
        pytest.skip("evicting between prompt chunks is H2O's option")
    before = stats(server)
    prompt, new = ids(LONG, 5), 6
    body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}}
    o1, seen = watch(server, body)
    after = stats(server)
    want, _ = prompt_evictions("h2o", 0, LONG)
    assert want == LONG // CHUNK  # every chunk: 64 rows over 48 + 8 from the first one on
    assert delta(after, before, "evictions") == delta(after, before, "compactions") == want
    assert delta(after, before, "rows_released") == delta(after, before, "slots_released") == LONG - BUDGET
    rec = chain(server, o1["meta_info"]["chain_id"])
    assert (rec["processed_tokens"], rec["retained_rows"]) == (LONG + new - 1, BUDGET + new - 1)
    assert after["kv_free_slots"] == before["kv_free_slots"] - (BUDGET + new - 1)  # exact slot accounting
    mid = [s for s in seen if s["logical_tokens"] - before["logical_tokens"] < LONG]  # still prefilling
    assert mid, "never observed the request between two of its prompt chunks"
    assert any(delta(s, before, "evictions") > 0 for s in mid), "no eviction counted during prefill"
    for s in seen:
        rows = s["retained_tokens"] - before["retained_tokens"]
        assert rows <= BUDGET + INTERVAL + CHUNK, s  # never the whole prompt
        assert s["kv_free_slots"] + s["retained_tokens"] == POOL, s
        assert s["integrity"]["ok"], s["integrity"]
    o2 = gen(server, prompt, new)  # the same prompt again, a new chain: the same greedy tokens
    assert o2["output_ids"] == o1["output_ids"]
    cid = o1["meta_info"]["chain_id"]
    p3 = prompt + o1["output_ids"] + ids(100, 6)
    mid_before = stats(server)
    o3 = gen(server, p3, 4, cid)
    m3 = o3["meta_info"]
    reused = LONG + new - 1
    assert (m3["chain_status"], m3["reused_tokens"], m3["cached_tokens"]) == ("resumed", reused, reused)
    # suffix of 101 tokens after 53 resumed rows: chunk 1 (64) -> 117 rows, evicted; chunk 2 (37) -> 85, evicted
    assert delta(stats(server), mid_before, "evictions") == prompt_evictions("h2o", BUDGET + new - 1, 101)[0] == 2
    assert chain(server, cid)["retained_rows"] == BUDGET + 3


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
    (["--sparse-method", "h2o", "--sparse-evict-prefill", "yes"], "evict_prefill='yes' is not allowed: must be on"),
])
def test_a_bad_flag_is_refused_at_start(request, flags, message):
    from sglang_sparse.server_process import ServerStartError

    with pytest.raises(ServerStartError) as err:
        start_server(flags, request, timeout=120)
    assert f"sglang_sparse: error: {message}" in str(err.value)


def test_info_lists_the_flat_pool_hook(server):
    """H2O and R-KV declare ``flat_kv_pool``: the scheduler keeps every layer's rows in one
    buffer, so an eviction wave moves (and R-KV scores) every layer in one launch."""
    info = requests.get(server.base_url + "/sparse/info", timeout=60).json()
    (scheduler,) = info["schedulers"]
    assert "hook:flat-kv-pool" in scheduler["registrations"], scheduler["registrations"]
    assert "hook:flat-kv-pool" not in info["launcher"]["registrations"]  # a scheduler-side hook
