"""``--tp-size 2`` through the real server on the CPU (issue 18): two gloo ranks, one per core,
each holding 2 of the 4 KV heads of ``sglang_sparse.tp_model`` (the default model with its last
KV group duplicated, the same function). Served in fp32, greedy tokens with ``--tp-size 2``
equal ``--tp-size 1`` exactly for dense-length prompts (which also equal HF), for SnapKV's
compacted prompts, for Quest's sparse decode and for Palu's latents (each rank its own heads'
share of the factors), across Chain Cache continuations; every rank
reports the same slot accounting (``/sparse/stats`` ``tp``), KVzip's global selection keeps the
ranks together, and ``/prune`` frees the same slots on both ranks. Each server in turn (two cores).

``make test`` runs SnapKV's pair of servers (compaction, Chain Cache, the ranks' census; 2.5 of
this module's 7.8 minutes); Quest, Palu and KVzip are ``slow`` (``make test-slow``): their
per-rank decisions are checked without a server by ``test_tp_agreement.py``."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import hf_argmax, start_server

pytestmark = pytest.mark.whole_machine  # binds its ranks' threads to cores 0 and 1 itself: run alone

POOL = 4096
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "256", "--dtype", "float32",
        "--log-level", "warning"]
SNAPKV = ["--sparse-method", "snapkv", "--sparse-budget", "64", "--sparse-window", "8"]
QUEST = ["--sparse-method", "quest", "--sparse-page-size", "4", "--sparse-token-budget", "64",
         "--sparse-dense-layers", "2"]
KVZIP = ["--sparse-method", "kvzip", "--sparse-keep-ratio", "0.3"]
PALU = ["--sparse-method", "palu", "--sparse-ratio", "0.5", "--sparse-residual", "32"]


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def gen(url, prompt, n, chain_id=None):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(url + "/generate", json={"input_ids": prompt, "sampling_params": sp}, timeout=900)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(url):
    return requests.get(url + "/sparse/stats", timeout=60).json()


@pytest.fixture(scope="module")
def model():
    from sglang_sparse.tp_model import ensure_tp_model

    return str(ensure_tp_model(log=lambda m: None))


def serve(request, model, method, tp):
    # one core per rank; the tp-1 server binds to core 0 like its rank 0
    env = {**os.environ, "SGLANG_CPU_OMP_THREADS_BIND": "0|1" if tp == 2 else "0"}
    return start_server([*ARGS, *method, "--model-path", model, "--tp-size", str(tp)], request, env=env)


def snapkv_turns(url):
    """A short prompt (no compaction: dense), a long one (compacted), its chain continuation."""
    short = gen(url, ids(40, 1), 16)
    first = gen(url, ids(300, 2), 12)
    cid = first["meta_info"]["chain_id"]
    second = gen(url, ids(300, 2) + first["output_ids"] + ids(30, 3), 12, cid)
    return {"short": short["output_ids"], "long": first["output_ids"], "continued": second["output_ids"],
            "status": second["meta_info"]["chain_status"], "stats": stats(url)}


def quest_turns(url):
    long = gen(url, ids(400, 4), 16)
    before = stats(url)
    resp = requests.post(url + "/prune", timeout=600, json={
        "token_ids": ids(400, 4), "ranges": [[100, 300]], "keep_tokens": 40, "policy": "snapkv", "wait": True})
    assert resp.status_code == 200, resp.text
    after = gen(url, ids(400, 4), 16)  # over the pruned prefix: the ranks must have kept the same tokens
    return {"long": long["output_ids"], "pruned": after["output_ids"], "cached": after["meta_info"]["cached_tokens"],
            "prune": resp.json(), "before": before, "stats": stats(url)}


def palu_turns(url):
    """Each rank projects its own heads through its share of the factors and stores their
    latents: a long prompt (blocks written) and its chain continuation."""
    first = gen(url, ids(300, 6), 12)
    second = gen(url, ids(300, 6) + first["output_ids"] + ids(40, 7), 12, first["meta_info"]["chain_id"])
    return {"long": first["output_ids"], "continued": second["output_ids"],
            "status": second["meta_info"]["chain_status"], "stats": stats(url)}


TURNS = {"snapkv": (SNAPKV, snapkv_turns), "quest": (QUEST, quest_turns), "palu": (PALU, palu_turns)}


@pytest.fixture(scope="module")
def runs(request, model):
    """``runs[name, tp]``: what ``TURNS[name]`` gave on a server of ``tp`` ranks (``kvzip`` on two
    only). Each method's servers start when a test first asks for it, one at a time, so a run of
    the default suite (SnapKV's tests only) starts two servers."""

    class Runs(dict):
        def __missing__(self, key):
            name, tp = key
            if name == "kvzip":
                server = serve(request, model, KVZIP, 2)
                self[key] = {"long": gen(server.base_url, ids(300, 5), 8)["output_ids"], "stats": stats(server.base_url)}
            else:
                method, turns = TURNS[name]
                server = serve(request, model, method, tp)
                self[key] = turns(server.base_url)
            server.stop()
            return self[key]

    return Runs()


def assert_ranks_agree(s):
    tp = s["tp"]
    assert tp["size"] == 2 and tp["agree"], tp["ranks"]
    assert all(r["integrity_ok"] and r["running_requests"] == 0 for r in tp["ranks"])


def test_snapkv_tokens_with_two_ranks_equal_one_rank(runs):
    one, two = runs["snapkv", 1], runs["snapkv", 2]
    for key in ("short", "long", "continued"):
        assert two[key] == one[key], key
    assert one["status"] == two["status"] == "resumed"
    assert one["stats"]["counters"]["slots_released"] == two["stats"]["counters"]["slots_released"] > 0
    assert "tp" not in one["stats"]
    assert_ranks_agree(two["stats"])
    # every slot is free or held by the idle chains, on both ranks
    for r in two["stats"]["tp"]["ranks"]:
        assert r["kv_free_slots"] + r["retained_tokens"] == r["kv_total_slots"]


def test_a_dense_length_prompt_equals_hf(runs, model):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    assert runs["snapkv", 2]["short"] == hf_argmax(hf, ids(40, 1), 16)


@pytest.mark.slow
def test_quest_tokens_and_prune_with_two_ranks_equal_one_rank(runs):
    one, two = runs["quest", 1], runs["quest", 2]
    assert two["long"] == one["long"]
    assert two["pruned"] == one["pruned"] and two["cached"] == one["cached"] == 396  # whole pages of 4
    for run in (one, two):
        assert run["prune"]["status"] == "completed" and run["prune"]["freed_slots"] == 160
        assert run["stats"]["kv_free_slots"] - run["before"]["kv_free_slots"] == 160
    assert_ranks_agree(two["before"])
    assert_ranks_agree(two["stats"])  # the same mask on both ranks: the same slots freed


@pytest.mark.slow
def test_palu_tokens_with_two_ranks_equal_one_rank(runs):
    """Compression: each rank holds the latents of its own head groups (``PaluFactors.shard``)."""
    one, two = runs["palu", 1], runs["palu", 2]
    assert two["long"] == one["long"] and two["continued"] == one["continued"]
    assert one["status"] == two["status"] == "resumed"
    assert two["stats"]["kv_bytes_per_token"] * 2 == one["stats"]["kv_bytes_per_token"]  # half the heads each
    assert_ranks_agree(two["stats"])


@pytest.mark.slow
def test_kvzip_ranks_keep_the_same_rows(runs):
    s = runs["kvzip", 2]["stats"]
    assert s["counters"]["compactions"] >= 1
    assert_ranks_agree(s)
