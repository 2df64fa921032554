"""Prefix-cache pruning through the real server (CPU, dense, KV pages of 4): exact slot
accounting, the pruned path still matched at full logical length, a needle outside the pruned
interval still found and one inside a zero-budget interval gone, busy prefixes blocked, bad input
answered with a 4xx, and every slot owned once after every test."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from conftest import assert_every_slot_owned_once, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import KEYS, NEEDLE, build_prompt, essays_tokens  # noqa: E402

PAGE, POOL, LEN = 4, 6144, 1024
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "512", "--log-level", "warning",
        "--dtype", "float32", "--page-size", str(PAGE)]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


@pytest.fixture(scope="module")
def haystack(tok):
    return essays_tokens(tok)


def needle_prompt(tok, hay, depth):
    ids = build_prompt(tok, hay, LEN, depth)
    needle = tok.encode(NEEDLE, add_special_tokens=False)
    start = next(i for i in range(len(ids)) if ids[i: i + len(needle)] == needle)
    return ids, (start, start + len(needle))


def gen(server, ids, n=1, ignore_eos=False):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": ignore_eos}}
    resp = requests.post(server.base_url + "/generate", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def found(out) -> bool:
    return any(k in out["text"].lower() for k in KEYS)


def prune(server, body):
    return requests.post(server.base_url + "/prune", json=body, timeout=600)


def stats(server):
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def inspect(server, ids):
    return requests.post(server.base_url + "/prefix/inspect", json={"token_ids": ids}, timeout=60).json()


@pytest.fixture(autouse=True)
def every_slot_accounted(server):
    yield
    assert_every_slot_owned_once(server)


def test_bad_input_gets_a_4xx_and_changes_nothing(server, tok, haystack):
    ids, _ = needle_prompt(tok, haystack[3000:], 0.5)
    gen(server, ids)
    before = stats(server)["kv_free_slots"]
    base = {"token_ids": ids, "keep_tokens": 8}
    cases = [
        ({**base, "ranges": [[400, 100]]}, 400, "reversed"),
        ({**base, "ranges": [[0, LEN + 100]]}, 400, "past the sequence"),
        ({**base, "ranges": [[101, 400]]}, 400, "aligned"),
        ({**base, "ranges": [[100, 400], [300, 500]]}, 400, "overlap"),
        ({**base, "ranges": [[100, 400]], "policy": "h2o"}, 400, "unknown policy"),
        ({"token_ids": ids, "ranges": [[100, 120]], "keep_tokens": 40}, 400, "more than the 20"),
        ({"token_ids": ids, "ranges": [[100, 120]], "keep_ratio": 0.5, "keep_tokens": 4}, 400, "exactly one"),
        ({**base, "ranges": "100-400"}, 400, "non-empty list"),
        ({"text": "this text was never sent to the server", "ranges": [[0, 4]], "keep_tokens": 0}, 404, "not cached"),
        ({"ranges": [[0, 4]], "keep_tokens": 0}, 400, "exactly one of token_ids"),
    ]
    for body, code, words in cases:
        resp = prune(server, body)
        assert resp.status_code == code and words in resp.text, (body.get("ranges"), resp.status_code, resp.text)
    assert requests.get(server.base_url + "/prune/prune-999", timeout=60).status_code == 404
    assert stats(server)["kv_free_slots"] == before
    assert inspect(server, ids)["retained_tokens"] == inspect(server, ids)["cached_tokens"]
    gen(server, ids)  # the scheduler is fine


def test_exact_accounting_full_logical_match_and_needle_outside_kept(server, tok, haystack):
    ids, (n0, n1) = needle_prompt(tok, haystack, 0.25)
    first = gen(server, ids, 24)
    assert found(first), first["text"]  # the unpruned baseline finds the needle
    cached = gen(server, ids, 1)["meta_info"]["cached_tokens"]
    left, right = 600, 900
    assert n1 < left
    before = stats(server)["kv_free_slots"]
    resp = prune(server, {"token_ids": ids, "ranges": [[left, right]], "keep_tokens": 40, "policy": "kvzip",
                          "wait": True})
    assert resp.status_code == 200, resp.text
    rec = resp.json()
    assert (rec["status"], rec["original_tokens"], rec["retained_tokens"], rec["freed_slots"]) == \
        ("completed", 300, 40, 260), rec
    assert stats(server)["kv_free_slots"] - before == 260  # interval length - kept, exactly
    view = inspect(server, ids)
    assert view["cached_tokens"] >= right and view["retained_tokens"] == view["cached_tokens"] - 260
    pruned = [b for b in view["blocks"] if b["pruning_records"]]
    assert pruned and {b["start"] for b in pruned} >= {left} and max(b["end"] for b in pruned) == right
    assert all(b["pruning_records"][0]["prune_id"] == rec["prune_id"] for b in pruned)
    after = gen(server, ids, 24)
    assert after["meta_info"]["cached_tokens"] == cached  # the whole logical prefix still matches
    assert found(after), after["text"]  # the needle lies outside the pruned interval


def test_needle_inside_a_zero_budget_interval_is_gone(server, tok, haystack):
    ids, (n0, n1) = needle_prompt(tok, haystack[1500:], 0.5)
    assert found(gen(server, ids, 24))
    left, right = n0 - n0 % PAGE, n1 + (-n1) % PAGE
    rec = prune(server, {"token_ids": ids, "ranges": [[left, right]], "keep_ratio": 0.0, "wait": True}).json()
    assert rec["status"] == "completed" and rec["retained_tokens"] == 0, rec
    out = gen(server, ids, 24)
    assert not found(out), out["text"]  # pruning really removed the needle's KV


def test_busy_prefix_is_blocked_then_async_prune_completes(server, tok, haystack):
    ids, _ = needle_prompt(tok, haystack[6000:], 0.9)
    gen(server, ids)
    long = threading.Thread(target=gen, args=(server, ids + [13, 42], 400, True))
    long.start()
    time.sleep(3)  # the long request now reads the whole prefix
    rec = prune(server, {"token_ids": ids, "ranges": [[100, 300]], "keep_ratio": 0.5, "wait": True}).json()
    assert rec["status"] == "blocked", rec
    view = inspect(server, ids)
    assert view["retained_tokens"] == view["cached_tokens"]  # nothing was pruned
    assert all(b["locked"] and not b["pruning_records"] for b in view["blocks"])
    long.join()
    resp = prune(server, {"token_ids": ids, "ranges": [[100, 300]], "keep_ratio": 0.5, "policy": "snapkv"})
    assert resp.status_code == 202, resp.text
    pid = resp.json()["prune_id"]
    for _ in range(300):
        rec = requests.get(f"{server.base_url}/prune/{pid}", timeout=60).json()
        if rec["status"] not in ("queued", "running"):
            break
        time.sleep(0.5)
    assert (rec["status"], rec["original_tokens"], rec["retained_tokens"]) == ("completed", 200, 100), rec


def test_prefix_priority_and_delete(server, tok, haystack):
    ids, _ = needle_prompt(tok, haystack[9000:], 0.1)
    gen(server, ids)
    url = server.base_url
    resp = requests.post(url + "/prefix/priority", json={"token_ids": ids, "priority": 5}, timeout=60)
    assert resp.status_code == 200 and resp.json()["priority"] == 5, resp.text
    assert all(b["priority"] == 5 for b in inspect(server, ids)["blocks"])
    bad = requests.post(url + "/prefix/priority", json={"token_ids": ids, "priority": "high"}, timeout=60)
    assert bad.status_code == 400 and "integer" in bad.text
    before = stats(server)["kv_free_slots"]
    cut = ids[:512]
    resp = requests.post(url + "/prefix/delete", json={"token_ids": cut}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert stats(server)["kv_free_slots"] - before == resp.json()["freed_slots"] > 0
    assert inspect(server, ids)["cached_tokens"] < 512
    gone = requests.post(url + "/prefix/delete", json={"token_ids": cut}, timeout=60)
    assert gone.status_code == 404 and "not cached" in gone.text
