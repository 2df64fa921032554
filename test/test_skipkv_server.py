"""SkipKV through the real server (CPU, default model; not a reasoning model: this checks the
runtime mechanism). One server: the scheduler reads the tokenizer's text of every token id and
each step's token ids (``segment_boundaries`` counts exactly the sentence ends of the prompt and
of the decoded tokens), every eviction frees exactly the rows it drops to SGLang's allocator,
``/sparse/stats`` counts evictions and rows released, a Chain Cache continuation resumes the
parked rows, scores and segments and prefills only its suffix, nothing leaks once the chains
are gone, and a bad flag stops the launcher with a sentence."""

from __future__ import annotations


import pytest
import requests

from conftest import start_server, watch
from sglang_sparse.methods.skipkv import ends_sentence

POOL, CHUNK, BUDGET, INTERVAL, MAX_SEGMENT = 512, 64, 64, 8, 16
FLAGS = ["--sparse-method", "skipkv", "--sparse-budget", str(BUDGET), "--sparse-sinks", "4",
         "--sparse-recent", "12", "--sparse-interval", str(INTERVAL), "--sparse-max-segment", str(MAX_SEGMENT)]
TEXT = ("The river rose in the night. Nobody in the village expected it! Why had the dam not held? "
        "The engineers had warned the council twice.\nIn the morning the square was under water. "
        "Children carried chairs to the church steps. Was anyone hurt? Only the baker's cat, "
        "which sulked on a roof until noon. ")


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    args = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", str(CHUNK), "--log-level", "warning",
            *FLAGS]  # --chain-cache auto: on
    return start_server(args, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def delta(after, before, key):
    return after["counters"].get(key, 0) - before["counters"].get(key, 0)


def sentence_ends(tok, ids) -> int:
    return sum(ends_sentence(t) for t in tok.batch_decode([[i] for i in ids]))


def body(prompt, n, chain_id=None) -> dict:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    return {"input_ids": prompt, "sampling_params": sp}


def gen(server, prompt, n, chain_id=None) -> dict:
    resp = requests.post(server.base_url + "/generate", json=body(prompt, n, chain_id), timeout=600)
    assert resp.status_code == 200, resp.text
    return resp.json()


def chain(server, chain_id) -> dict:
    return requests.get(f"{server.base_url}/chain/{chain_id}", timeout=60).json()


def test_every_eviction_frees_exactly_the_rows_it_drops(server, tok):
    prompt = tok.encode(TEXT * 3)[:150]
    new = 24
    before = stats(server)
    o, seen = watch(server, body(prompt, new), poll=0.3)
    after = stats(server)
    processed = prompt + o["output_ids"][:-1]  # the last token's KV is never written
    assert delta(after, before, "segment_boundaries") == sentence_ends(tok, processed) > 5
    evictions = delta(after, before, "evictions")
    assert evictions >= 1 + (new - 1) // (INTERVAL + MAX_SEGMENT)  # the prompt's, then while decoding
    assert delta(after, before, "compactions") == evictions
    assert delta(after, before, "segments_dropped") >= evictions  # each drops at least one segment
    released = delta(after, before, "rows_released")
    assert delta(after, before, "slots_released") == released
    rec = chain(server, o["meta_info"]["chain_id"])
    assert rec["processed_tokens"] == len(processed)
    assert rec["retained_rows"] == len(processed) - released <= BUDGET + INTERVAL
    assert after["kv_free_slots"] == before["kv_free_slots"] - rec["retained_rows"]  # freed what it dropped
    assert seen, "never observed the running request"
    for s in seen:  # snapshots between scheduler steps: every resident row accounted, census clean
        assert s["kv_free_slots"] + s["retained_tokens"] == POOL, s
        assert s["integrity"]["ok"], s["integrity"]


def test_chain_continuation_resumes_and_prefills_only_its_suffix(server, tok):
    p1 = tok.encode(TEXT * 2)[:100]
    o1 = gen(server, p1, 4)
    cid = o1["meta_info"]["chain_id"]
    kept = chain(server, cid)["retained_rows"]
    assert BUDGET - MAX_SEGMENT < kept <= BUDGET + 3
    before = stats(server)
    p2 = p1 + o1["output_ids"] + tok.encode(" The water went down at last.")
    o2 = gen(server, p2, 4, cid)
    m2 = o2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"], m2["reused_tokens"]) == (cid, "resumed", 103)
    assert m2["cached_tokens"] == 103  # SGLang prefilled only the suffix
    after = stats(server)
    suffix = p2[103:] + o2["output_ids"][:-1]
    assert delta(after, before, "segment_boundaries") == sentence_ends(tok, suffix)  # only the new tokens
    rec = chain(server, cid)
    assert rec["processed_tokens"] == len(p2) + 3
    assert rec["retained_rows"] == kept + len(suffix) - delta(after, before, "rows_released")


def test_retention_map_shows_whole_sentences_kept_alike_in_every_layer_and_head(server, tok):
    """``GET /chain/{id}/retention``: SkipKV's segment scores are shared by every layer and KV
    head, so every head keeps the same logical positions: the sinks, the rows decoded after the
    last eviction, and no sentence cut in two outside the sinks and the recent window."""
    p = tok.encode(TEXT * 2)[:100]
    o = gen(server, p, 4)
    cid = o["meta_info"]["chain_id"]
    rec = chain(server, cid)
    resp = requests.get(f"{server.base_url}/chain/{cid}/retention", params={"format": "positions"}, timeout=60)
    assert resp.status_code == 200, resp.text
    r = resp.json()
    assert (r["method"], r["logical_len"], r["retained_rows"]) == ("skipkv", 103, rec["retained_rows"])
    maps = {str(h["positions"]) for layer in r["layers"] for h in layer["heads"]}
    assert len(maps) == 1  # one choice for the whole request
    pos = r["layers"][0]["heads"][0]["positions"]
    assert len(pos) == rec["retained_rows"] < 103 and pos == sorted(set(pos))
    assert set(range(4)) | {100, 101, 102} <= set(pos)  # sinks + the 3 decoded rows
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)


def test_a_long_prompt_is_evicted_between_its_chunks(server, tok):
    """``--sparse-evict-prefill on`` (the default): a 7-chunk prompt is evicted after every chunk
    that leaves it INTERVAL or more rows past the budget (chunks 2..7), not only after its last;
    held whole it would be evicted once. (The last chunk's eviction applies at the next safe
    point, so the request decodes a second token to reach it.)"""
    prompt = tok.encode(TEXT * 8)[: 7 * CHUNK]
    before = stats(server)
    o = gen(server, prompt, 2)
    after = stats(server)
    assert delta(after, before, "evictions") >= 6, after["counters"]
    assert delta(after, before, "slots_released") == delta(after, before, "rows_released")
    rec = chain(server, o["meta_info"]["chain_id"])
    assert rec["processed_tokens"] == len(prompt) + 1
    assert rec["retained_rows"] <= BUDGET + INTERVAL


def test_nothing_leaks_once_the_chains_are_gone(server):
    chains = requests.get(server.base_url + "/chain", timeout=60).json()["chains"]
    for c in [c for c in chains if c["status"] == "idle"]:
        assert requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60).status_code == 200
    s = stats(server)
    assert s["running_requests"] == 0 and s["kv_free_slots"] == POOL, s
    assert s["integrity"]["ok"], s["integrity"]


def test_a_bad_flag_is_refused_at_start(request):
    from sglang_sparse.server_process import ServerStartError

    with pytest.raises(ServerStartError) as err:
        start_server(["--sparse-method", "skipkv", "--sparse-budget", "100", "--sparse-recent", "64"], request,
                     timeout=120)
    assert "sglang_sparse: error: budget=100 is out of range: must be >= sinks + recent + max_segment = 132" \
        in str(err.value)
