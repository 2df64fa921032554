"""The logical radix cache (srt/radix.py) through the real server, with a full-KV method (dense)
and Chain Cache on: prefixes are reused through the tree, a chain continuation equals a fresh
request over the whole context, a chain's prefix is pinned against eviction, and every KV slot
has exactly one owner after every test."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import assert_every_slot_owned_once, expand_ranges, start_server, stream_and_get

POOL = 1536
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--log-level", "warning",
        "--dtype", "float32", "--sparse-method", "dense", "--chain-cache", "on",
        "--max-running-requests", "1"]  # one at a time: a second request waits in the queue


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def gen(server, ids, n, chain_id=None, salt=None):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    if chain_id is not None:
        body["chain_id"] = chain_id
    if salt is not None:
        body["cache_salt"] = salt  # another prefix-cache namespace: nothing is reused
    resp = requests.post(server.base_url + "/generate", json=body, timeout=600)
    return resp.status_code, resp.json()


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


@pytest.fixture(autouse=True)
def every_slot_accounted(server):
    yield
    assert_every_slot_owned_once(server)


def test_backend_is_the_logical_radix_cache(server):
    radix = stats(server)["radix"]
    assert radix["backend"] == "sglang_sparse" and radix["enabled"]


def test_prefix_reuse_through_the_tree(server):
    p = ids(200, 1)
    code, a = gen(server, p + ids(10, 2), 4, salt="reuse")
    assert code == 200, a
    code, b = gen(server, p + ids(10, 3), 4, salt="reuse")
    assert code == 200, b
    assert b["meta_info"]["cached_tokens"] >= 200
    code, c = gen(server, p + ids(10, 3), 4, salt="reuse-fresh")
    assert c["meta_info"]["cached_tokens"] == 0
    assert b["output_ids"] == c["output_ids"]  # reused KV decodes exactly like fresh KV


def test_full_kv_chain_continuation_equals_a_fresh_request(server):
    p1 = ids(150, 4)
    code, o1 = gen(server, p1, 6)
    assert code == 200, o1
    m1 = o1["meta_info"]
    assert m1["chain_status"] == "created"
    cid = m1["chain_id"]
    chain = requests.get(f"{server.base_url}/chain/{cid}", timeout=60).json()
    assert chain["status"] == "idle" and chain["processed_tokens"] == 155
    p2 = p1 + o1["output_ids"] + ids(30, 5)
    code, o2 = gen(server, p2, 8, chain_id=cid)
    assert code == 200, o2
    m2 = o2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"]) == (cid, "resumed")
    assert m2["cached_tokens"] == m2["reused_tokens"] == 155  # the boundary, from the pinned path
    code, fresh = gen(server, p2, 8, salt="fresh-chain")
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert o2["output_ids"] == fresh["output_ids"]
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
    requests.delete(f"{server.base_url}/chain/{fresh['meta_info']['chain_id']}", timeout=60)
    requests.delete(f"{server.base_url}/chain/{o2['meta_info']['chain_id']}", timeout=60)


def test_pinned_chain_prefix_survives_eviction(server):
    p1 = ids(300, 6)
    code, o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    before = stats(server)["radix"]["protected_slots"]
    assert before >= 303
    # other traffic that needs the whole rest of the pool: unpinned cache is evicted, the pin stays
    for seed in range(7, 12):
        code, out = gen(server, ids(400, seed), 4, salt=f"pressure-{seed}")
        assert code == 200, out
        requests.delete(f"{server.base_url}/chain/{out['meta_info']['chain_id']}", timeout=60)
    code, o2 = gen(server, p1 + o1["output_ids"] + ids(10, 13), 4, chain_id=cid)
    assert code == 200, o2
    assert o2["meta_info"]["cached_tokens"] >= 303
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)


def test_cancelled_queued_continuation_does_not_leave_its_chain_active(server):
    _, o1 = gen(server, ids(80, 20), 3)
    cid = o1["meta_info"]["chain_id"]
    url = server.base_url
    long = threading.Thread(target=gen, args=(server, ids(60, 21), 400, None, "busy"))
    long.start()  # occupies the only running slot
    time.sleep(3)
    body = {"input_ids": ids(80, 20) + o1["output_ids"] + ids(5, 22), "chain_id": cid, "rid": "queued-cont",
            "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
    waiting = threading.Thread(target=requests.post, args=(url + "/generate",), kwargs={"json": body, "timeout": 600})
    waiting.start()
    time.sleep(2)
    assert requests.get(f"{url}/chain/{cid}", timeout=60).json()["status"] == "active"
    queued = requests.get(f"{url}/sparse/requests/queued-cont/retention", timeout=60)
    assert queued.status_code == 409 and "still waiting" in queued.json()["message"], queued.text
    requests.post(url + "/abort_request", json={"rid": "queued-cont"}, timeout=60)
    waiting.join()
    long.join()
    rec = requests.get(f"{url}/chain/{cid}", timeout=60).json()
    assert rec["status"] == "invalidated", rec
    for c in requests.get(url + "/chain", timeout=60).json()["chains"]:
        if c["status"] == "idle":
            requests.delete(f"{url}/chain/{c['chain_id']}", timeout=60)


def test_a_finished_request_is_split_at_its_prompt_as_sglang_does(server):
    """SGLang caches a finished request's path in two parts: the prompt (priority + 1) and the
    output after it, so eviction drops the output first. The tree does the same."""
    prompt = ids(60, 40)
    code, out = gen(server, prompt, 8, salt="split")
    assert code == 200, out
    seq = prompt + out["output_ids"][:-1]  # the last output token has no KV
    blocks = requests.post(server.base_url + "/prefix/inspect", timeout=60,
                           json={"token_ids": seq, "cache_salt": "split"}).json()["blocks"]
    assert [(b["start"], b["end"]) for b in blocks] == [(0, 60), (60, 67)]
    assert [b["priority"] for b in blocks] == [1, 0]


def assert_everything_kept(r, logical_len):
    assert r["method"] == "dense" and r["logical_len"] == logical_len and r["kept_fraction"] == 1.0
    assert len(r["layers"]) == r["num_layers"] > 0
    for layer in r["layers"]:
        assert [h["ranges"] for h in layer["heads"]] == [[[0, logical_len]]] * r["kv_heads"], layer


def test_retention_of_full_kv_requests_and_chains_is_every_position(server):
    rid, prompt = "retention-dense", ids(120, 30)
    body = {"input_ids": prompt, "rid": rid, "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                                 "ignore_eos": True}}
    mid, first, _ = stream_and_get(server, body, f"/sparse/requests/{rid}/retention")
    assert mid.status_code == 200, mid.text
    r = mid.json()
    assert r["rid"] == rid and 120 <= r["logical_len"] == r["retained_rows"] < 152
    assert_everything_kept(r, r["logical_len"])
    missing = requests.get(f"{server.base_url}/sparse/requests/{rid}/retention", timeout=60)
    assert missing.status_code == 404 and "no running request" in missing.json()["message"], missing.text
    cid = first["meta_info"]["chain_id"]
    c = requests.get(f"{server.base_url}/chain/{cid}/retention", params={"format": "positions"}, timeout=60).json()
    assert c["chain_id"] == cid and c["status"] == "idle"
    assert_everything_kept(c, 151)  # the pinned path: prompt + every output token but the last
    assert c["layers"][-1]["heads"][0]["positions"] == expand_ranges([[0, 151]])
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
