"""Chain Cache through the real server (CPU, SnapKV): a continuation prefills only its suffix on
top of the compacted KV of the earlier turn, errors have their codes and leave other requests
alone, idle chains are reclaimed least recently used, and every KV row is accounted for."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import expand_ranges, start_server, stream_and_get

BUDGET, POOL, WINDOW = 64, 4096, 8
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--log-level", "warning",
        "--dtype", "float32", "--sparse-method", "snapkv", "--sparse-budget", str(BUDGET),
        "--sparse-window", str(WINDOW)]  # --chain-cache auto: on for SnapKV


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def gen(server, ids, n, chain_id=None, timeout=600):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", json={"input_ids": ids, "sampling_params": sp},
                         timeout=timeout)
    body = resp.json()
    if "message" not in body and "error" in body:  # SGLang's 400 shape: {"error": {"message": ...}}
        err = body["error"]
        body["message"] = err if isinstance(err, str) else err["message"]
    return resp.status_code, body


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def chain(server, chain_id) -> dict:
    return requests.get(f"{server.base_url}/chain/{chain_id}", timeout=60).json()


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def assert_rows_accounted(server):
    """Nothing running: every slot is free or held by an idle chain, and the slot census (the
    allocator's free list against every chain's and request's rows) finds no slot owned twice
    or lost."""
    s = stats(server)
    assert s["running_requests"] == 0
    assert s["kv_free_slots"] + s["chain_idle_rows"] == s["kv_total_slots"]
    integrity = requests.get(server.base_url + "/chain", timeout=60).json()["integrity"]
    assert integrity["ok"], integrity


def test_continuation_prefills_only_the_suffix_over_compacted_kv(server):
    before = stats(server)["counters"]
    p1 = ids(300, 1)
    code, o1 = gen(server, p1, 6)
    assert code == 200, o1
    m1 = o1["meta_info"]
    assert (m1["chain_status"], m1["reused_tokens"]) == ("created", 0)
    cid = m1["chain_id"]
    # processed boundary: the prompt and every output token but the last (it has no KV yet)
    rec = chain(server, cid)
    assert (rec["status"], rec["processed_tokens"], rec["retained_rows"]) == ("idle", 305, BUDGET + 5)
    assert_rows_accounted(server)

    p2 = p1 + o1["output_ids"] + ids(40, 2)
    code, o2 = gen(server, p2, 6, cid)
    assert code == 200, o2
    m2 = o2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"], m2["reused_tokens"]) == (cid, "resumed", 305)
    assert m2["cached_tokens"] == 305  # SGLang prefilled only the 41-token suffix
    after = stats(server)["counters"]
    # turn 2 compacted its 69 resumed rows + 41 new ones back to the budget
    assert after["compactions"] - before["compactions"] == 2
    assert after["slots_released"] - before["slots_released"] == (300 - BUDGET) + (BUDGET + 5 + 41 - BUDGET)
    rec = chain(server, cid)
    assert (rec["status"], rec["processed_tokens"], rec["retained_rows"]) == ("idle", 351, BUDGET + 5)
    assert_rows_accounted(server)


def test_a_one_token_answer_parks_its_compacted_rows(server):
    """SnapKV plans its compaction after the prompt; with one output token the request finishes in
    that same step. The chain must park the budget, not the whole prompt, and resume from it."""
    before = stats(server)["counters"]
    p1 = ids(300, 21)
    code, o1 = gen(server, p1, 1)
    assert code == 200, o1
    cid = o1["meta_info"]["chain_id"]
    rec = chain(server, cid)
    assert (rec["status"], rec["processed_tokens"], rec["retained_rows"]) == ("idle", 300, BUDGET)
    assert stats(server)["counters"]["slots_released"] - before["slots_released"] == 300 - BUDGET
    assert_rows_accounted(server)
    code, o2 = gen(server, p1 + ids(20, 22), 1, cid)
    assert code == 200, o2
    assert (o2["meta_info"]["chain_status"], o2["meta_info"]["reused_tokens"]) == ("resumed", 300)
    assert chain(server, cid)["retained_rows"] == BUDGET
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).json()["freed_rows"] == BUDGET
    assert_rows_accounted(server)


def test_top_level_chain_id_and_openai_requests_resume_chains(server):
    url = server.base_url
    p1 = ids(120, 16)
    _, o1 = gen(server, p1, 3)
    cid = o1["meta_info"]["chain_id"]
    p2 = p1 + o1["output_ids"] + ids(10, 17)
    r2 = requests.post(url + "/generate", timeout=600, json={
        "input_ids": p2, "chain_id": cid, "sampling_params": {"temperature": 0, "max_new_tokens": 3,
                                                               "ignore_eos": True}}).json()
    m = r2["meta_info"]
    assert (m["chain_id"], m["chain_status"], m["reused_tokens"]) == (cid, "resumed", 122)
    # OpenAI completions over token ids continue the chain too; `usage` carries the chain fields
    p3 = p2 + r2["output_ids"] + ids(6, 18)
    done = requests.post(url + "/v1/completions", timeout=600, json={
        "model": "default", "prompt": p3, "max_tokens": 2, "temperature": 0, "chain_id": cid})
    assert done.status_code == 200, done.text
    usage = done.json()["usage"]
    boundary = len(p2) + len(r2["output_ids"]) - 1
    assert (usage["chain_id"], usage["chain_status"], usage["reused_tokens"]) == (cid, "resumed", boundary)
    assert chain(server, cid)["processed_tokens"] == len(p3) + usage["completion_tokens"] - 1
    # streamed: the final usage chunk carries them as well
    p4 = list(p3) + ids(4, 19)  # the completion tokens were not returned as ids: start a new chain
    lines = requests.post(url + "/v1/completions", timeout=600, stream=True, json={
        "model": "default", "prompt": p4, "max_tokens": 2, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}).iter_lines()
    chunks = [json.loads(x[6:]) for x in lines if x.startswith(b"data: {")]
    streamed = [c["usage"] for c in chunks if c.get("usage")][-1]
    assert streamed["chain_status"] == "created" and streamed["chain_id"].startswith("chain-")
    assert streamed["reused_tokens"] == 0
    bad = requests.post(url + "/v1/completions", timeout=600, json={
        "model": "default", "prompt": [7] + p3, "max_tokens": 2, "chain_id": cid})
    assert bad.status_code == 409 and "diverges" in bad.text, bad.text
    assert_rows_accounted(server)


def test_short_continuation_equals_a_fresh_request_over_the_full_context(server):
    """Below the budget nothing is evicted, so resuming the chain must give exactly the tokens
    of a new request over the whole context (same KV, same positions)."""
    p1 = ids(20, 3)
    _, o1 = gen(server, p1, 5)
    p2 = p1 + o1["output_ids"] + ids(15, 4)
    _, resumed = gen(server, p2, 8, o1["meta_info"]["chain_id"])
    _, fresh = gen(server, p2, 8)
    assert resumed["meta_info"]["reused_tokens"] == 24 and fresh["meta_info"]["reused_tokens"] == 0
    assert resumed["output_ids"] == fresh["output_ids"]


def test_errors_have_their_codes_and_leave_other_requests_alone(server):
    p1 = ids(200, 5)
    _, o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    cases = [
        (ids(50, 6), "chain-nope", 404, "unknown chain 'chain-nope'"),
        ([7] + p1 + o1["output_ids"], cid, 409, "diverges from the chain's processed prefix at token 0"),
        (p1[:100], cid, 409, "must extend the 203 processed tokens"),
    ]
    for prompt, chain_id, code, msg in cases:
        got, body = gen(server, prompt, 4, chain_id)
        assert got == code and msg in body["message"], body
    # never fits: the chain's rows + the suffix + 6000 output tokens exceed the 4096-slot pool
    got, body = gen(server, p1 + o1["output_ids"] + ids(5, 9), 6000, cid)
    assert got == 400 and "the pool has 4096" in body["message"], body
    assert chain(server, cid)["status"] == "idle"  # refused, not lost
    # busy: a second request on a chain that is running
    box = {}
    long = threading.Thread(target=lambda: box.update(r=gen(server, p1 + o1["output_ids"] + ids(10, 7), 300, cid)))
    long.start()
    for _ in range(600):
        if chain(server, cid)["status"] == "active":
            break
        threading.Event().wait(0.1)
    code, body = gen(server, p1 + o1["output_ids"] + ids(12, 8), 4, cid)
    assert code == 409 and "in use" in body["message"], body
    long.join()
    assert box["r"][0] == 200 and box["r"][1]["meta_info"]["completion_tokens"] == 300
    assert requests.get(server.base_url + "/chain/chain-nope", timeout=60).status_code == 404
    assert_rows_accounted(server)


def test_a_continuation_longer_than_the_max_input_is_refused_and_the_chain_kept(server):
    """The chain's 67 kept rows + 3,900 new tokens fit the pool, but its 4,200 logical tokens are
    more than SGLang takes in one request (4,090 on this pool): a 400 naming input_ids, plain and
    streamed, the chain idle and resumable afterwards, and a scheduler still alive (it used to die
    preparing the aborted request's extend over the lent rows)."""
    p1 = ids(300, 21)
    _, o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    before = chain(server, cid)
    too_long = p1 + o1["output_ids"] + ids(3900, 22)
    got, body = gen(server, too_long, 4, cid)
    assert got == 400 and body["message"].startswith("input_ids: the continuation of chain"), body
    assert "4204 tokens (303 from the chain, 3901 new)" in body["message"], body
    sp = {"temperature": 0, "max_new_tokens": 4, "custom_params": {"chain_id": cid}}
    with requests.post(server.base_url + "/generate", json={"input_ids": too_long, "sampling_params": sp,
                                                           "stream": True}, stream=True, timeout=600) as resp:
        text = resp.text
    assert resp.status_code in (200, 400) and "input_ids: the continuation of chain" in text, text
    after = chain(server, cid)
    assert (after["status"], after["processed_tokens"], after["retained_rows"]) == \
        ("idle", before["processed_tokens"], before["retained_rows"])
    code, o2 = gen(server, p1 + o1["output_ids"] + ids(20, 23), 4, cid)
    assert code == 200 and (o2["meta_info"]["chain_status"], o2["meta_info"]["reused_tokens"]) == ("resumed", 303)
    assert_rows_accounted(server)


def test_idle_chains_are_reclaimed_least_recently_used_and_then_answer_410(server):
    chains = requests.get(server.base_url + "/chain", timeout=60).json()["chains"]
    idle = sorted((c for c in chains if c["status"] == "idle"), key=lambda c: c["last_use"])
    assert len(idle) >= 3
    free = stats(server)["kv_free_slots"]
    oldest = idle[0]
    # needs the free slots plus the oldest idle chain's rows: the oldest goes first (SGLang's own
    # admission margins may take one or two more, in the same order)
    code, body = gen(server, ids(free + oldest["retained_rows"] - 1, 9), 1, timeout=300)
    assert code == 200, body
    after = {c["chain_id"]: c["status"] for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]}
    assert after[oldest["chain_id"]] == "reclaimed"
    # least recently used first: the reclaimed ones are a prefix of the idle chains by last use
    went = [after[c["chain_id"]] == "reclaimed" for c in idle]
    assert went == sorted(went, reverse=True) and not all(went)
    code, body = gen(server, ids(10, 10), 1, oldest["chain_id"])
    assert code == 410 and "reclaimed" in body["message"], body
    assert_rows_accounted(server)


def test_sglang_sessions_are_chains(server):
    """SGLang's own session API: each turn of a session resumes the session's chain."""
    url = server.base_url
    sid = requests.post(url + "/open_session", json={"capacity_of_str_len": 100000}, timeout=60).json()
    sp = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    r1 = requests.post(url + "/generate", timeout=600, json={
        "input_ids": ids(200, 14), "session_params": {"id": sid}, "sampling_params": sp}).json()
    m1 = r1["meta_info"]
    assert (m1["chain_id"], m1["chain_status"]) == (f"session-{sid}", "created")
    r2 = requests.post(url + "/generate", timeout=600, json={
        "input_ids": ids(20, 15), "session_params": {"id": sid, "rid": m1["id"]}, "sampling_params": sp}).json()
    m2 = r2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"], m2["reused_tokens"]) == (f"session-{sid}", "resumed", 203)
    assert m2["cached_tokens"] == 203 and m2["prompt_tokens"] == 224  # 200 + 4 + 20 sent, 21 prefilled
    assert requests.post(url + "/close_session", json={"session_id": sid}, timeout=60).status_code == 200
    assert requests.get(f"{url}/chain/session-{sid}", timeout=60).status_code == 404
    assert_rows_accounted(server)


def test_delete_frees_an_idle_chain_and_refuses_busy_or_unknown_ones(server):
    _, o1 = gen(server, ids(150, 11), 3)
    cid = o1["meta_info"]["chain_id"]
    free = stats(server)["kv_free_slots"]
    rows = chain(server, cid)["retained_rows"]
    resp = requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
    assert resp.status_code == 200 and resp.json()["freed_rows"] == rows
    assert stats(server)["kv_free_slots"] == free + rows
    assert requests.get(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 404
    resp = requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
    assert resp.status_code == 404 and "unknown chain" in resp.json()["message"]
    # a running chain cannot be deleted
    _, o2 = gen(server, ids(100, 12), 2)
    cid2 = o2["meta_info"]["chain_id"]
    box = {}
    t = threading.Thread(target=lambda: box.update(r=gen(server, ids(100, 12) + o2["output_ids"][:1] + ids(5, 13),
                                                          200, cid2)))
    t.start()
    for _ in range(600):
        if chain(server, cid2)["status"] == "active":
            break
        threading.Event().wait(0.1)
    resp = requests.delete(f"{server.base_url}/chain/{cid2}", timeout=60)
    assert resp.status_code == 409 and "in use" in resp.json()["message"]
    t.join()
    assert box["r"][0] == 200
    # deleting every chain gives the whole pool back
    for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]:
        requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60)
    s = stats(server)
    assert s["kv_free_slots"] == s["kv_total_slots"] and s["chain_idle_rows"] == 0
    assert_rows_accounted(server)


def test_prune_is_refused_for_a_method_that_evicts(server):
    resp = requests.post(server.base_url + "/prune", timeout=60, json={
        "token_ids": ids(64, 30), "ranges": [[0, 16]], "keep_ratio": 0.5})
    assert resp.status_code == 409 and "radix cache is off" in resp.text, resp.text


def test_unknown_chains_in_a_concurrent_batch_leave_the_others_served(server):
    """Eight requests at once, half naming unknown chains: the refused ones finish in the same
    prefill batch as the others (one token each), whose chain fields SGLang pads with None for
    them. That killed the tokenizer process; now every request gets its answer."""
    def one(i):
        body = {"input_ids": ids(40, 40 + i), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        if i % 2:
            body["chain_id"] = f"chain-missing-{i}"
        resp = requests.post(server.base_url + "/generate", json=body, timeout=300)
        return resp.status_code, resp.json()

    for _ in range(2):
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        for i, (code, body) in enumerate(results):
            if i % 2:
                assert code == 404 and body["message"] == f"unknown chain 'chain-missing-{i}'", body
            else:
                assert code == 200 and body["meta_info"]["chain_status"] == "created", body
    assert_rows_accounted(server)


def test_stats_count_what_idle_chains_hold(server):
    """After the requests finish, their compacted KV sits in idle chains: logical and retained
    tokens count it (by owner), with the compression ratio."""
    _, out = gen(server, ids(400, 50), 3)
    rec = chain(server, out["meta_info"]["chain_id"])
    s = stats(server)
    owners = s["by_owner"]
    assert owners["requests"] == {"logical_tokens": 0, "retained_tokens": 0}
    assert owners["chains"]["retained_tokens"] == s["chain_idle_rows"] >= rec["retained_rows"] == BUDGET + 2
    assert owners["chains"]["logical_tokens"] >= rec["processed_tokens"] == 402
    assert s["logical_tokens"] == sum(o["logical_tokens"] for o in owners.values())
    assert s["retained_tokens"] == sum(o["retained_tokens"] for o in owners.values())
    assert s["compression_ratio"] == round(s["logical_tokens"] / s["retained_tokens"], 3) > 1


def test_a_retry_right_after_a_cancel_finds_the_chain_gone(server):
    """A client gives up on a turn (its connection closes) and retries at once: the chain the
    cancelled turn was continuing is lost (410), not busy (409) for the seconds SGLang takes to
    notice the closed connection."""
    p1 = ids(200, 60)
    _, o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    p2 = p1 + o1["output_ids"] + ids(8, 61)
    with pytest.raises(requests.exceptions.ReadTimeout):
        gen(server, p2, 2000, cid, timeout=2.0)  # still decoding when the client leaves
    code, body = gen(server, p2, 2, cid)
    assert code == 410 and "its request was aborted" in body["message"], body
    _wait_idle(server)
    assert chain(server, cid)["status"] == "invalidated"
    gone = requests.get(f"{server.base_url}/chain/{cid}/retention", timeout=60)
    assert gone.status_code == 410 and "keeps no KV" in gone.json()["message"], gone.text
    assert_rows_accounted(server)


def _wait_idle(server, timeout=120):
    for _ in range(int(timeout / 0.2)):
        if stats(server)["running_requests"] == 0:
            return
        threading.Event().wait(0.2)
    raise AssertionError("requests still running")


def retention(server, path, **params):
    return requests.get(server.base_url + path, params=params, timeout=60)


def assert_snapkv_map(r, prompt: int, rows: int):
    """Every layer and KV head keeps exactly the ``rows`` the cache holds: logical positions in
    ``[0, logical_len)``, the observation window and every decoded token among them."""
    assert r["method"] == "snapkv" and r["retained_rows"] == rows
    assert len(r["layers"]) == r["num_layers"] > 0 and r["kv_heads"] > 0
    recent = set(range(prompt - WINDOW, r["logical_len"]))
    for layer in r["layers"]:
        assert len(layer["heads"]) == r["kv_heads"]
        for head in layer["heads"]:
            kept = expand_ranges(head["ranges"])
            assert head["kept"] == len(kept) == rows, (layer["layer"], head)
            assert kept == sorted(set(kept)) and 0 <= kept[0] and kept[-1] < r["logical_len"]
            assert recent <= set(kept)
    assert r["kept"] == rows * r["num_layers"] * r["kv_heads"]
    assert r["kept_fraction"] == pytest.approx(rows / r["logical_len"], abs=1e-5)


def test_retention_map_of_a_chain_is_what_the_cache_retains(server):
    _, out = gen(server, ids(300, 70), 6)
    cid = out["meta_info"]["chain_id"]
    rec = chain(server, cid)
    resp = retention(server, f"/chain/{cid}/retention")
    assert resp.status_code == 200, resp.text
    r = resp.json()
    assert (r["chain_id"], r["status"], r["logical_len"]) == (cid, "idle", rec["processed_tokens"])
    assert_snapkv_map(r, 300, rec["retained_rows"])
    assert rec["retained_rows"] == BUDGET + 5
    # SnapKV chooses per KV head: the heads of a layer do not all keep the same prompt positions
    assert any(len({str(h["ranges"]) for h in layer["heads"]}) > 1 for layer in r["layers"])
    sub = retention(server, f"/chain/{cid}/retention", layers="2,0", format="positions").json()
    assert [x["layer"] for x in sub["layers"]] == [0, 2]
    assert sub["layers"][1]["heads"][0]["positions"] == expand_ranges(r["layers"][2]["heads"][0]["ranges"])
    assert sub["kept"] == 2 * rec["retained_rows"] * r["kv_heads"]
    for params, field, words in (({"layers": "0,x"}, "layers", "comma-separated"),
                                 ({"layers": str(r["num_layers"])}, "layers", "out of range"),
                                 ({"layers": "-1"}, "layers", "out of range"),
                                 ({"format": "csv"}, "format", "ranges, positions"),
                                 ({"layer": "0"}, "layer", "unknown query parameter")):
        bad = retention(server, f"/chain/{cid}/retention", **params)
        assert bad.status_code == 400 and bad.json()["param"] == field and words in bad.json()["message"], bad.text
    missing = retention(server, "/chain/chain-nope/retention")
    assert missing.status_code == 404 and missing.json()["message"] == "unknown chain 'chain-nope'", missing.text
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
    assert retention(server, f"/chain/{cid}/retention").status_code == 404
    assert_rows_accounted(server)


def test_retention_map_of_a_running_request_then_404_once_it_finished(server):
    rid, prompt = "retention-running", 200
    body = {"input_ids": ids(prompt, 71), "rid": rid,
            "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}}
    mid, first, _ = stream_and_get(server, body, f"/sparse/requests/{rid}/retention")
    assert mid.status_code == 200, mid.text
    r = mid.json()
    assert r["rid"] == rid and prompt <= r["logical_len"] < prompt + 32
    assert_snapkv_map(r, prompt, BUDGET + r["logical_len"] - prompt)  # compacted after the prompt
    gone = retention(server, f"/sparse/requests/{rid}/retention")
    assert gone.status_code == 404 and gone.json()["param"] == "rid" and "no running request" in gone.text
    requests.delete(f"{server.base_url}/chain/{first['meta_info']['chain_id']}", timeout=60)
    assert_rows_accounted(server)
