"""RetroInfer through the real server (CPU, torch_native backend, a small KV pool): a prompt whose
clusters are all retrieved answers exactly like dense, a longer one with estimation stays close to
dense, the cold rows sit in the host tier while the request runs (host bytes > 0, the exact
count; device bytes below a dense request's), slots, host rows and cached clusters all come back
afterwards, the host_bytes gauge, and a bad flag is refused with a sentence."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import greedy, run_together, sparse_stats, start_server

SINKS, LOCAL, TPC, RETRIEVE, POOL = 4, 32, 8, 16, 4096
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # the default model
ARGS = ["--max-total-tokens", str(POOL), "--log-level", "warning", "--dtype", "float32", "--enable-metrics",
        "--sparse-method", "retroinfer", "--sparse-sinks", str(SINKS), "--sparse-local", str(LOCAL),
        "--sparse-tokens-per-cluster", str(TPC), "--sparse-retrieve", str(RETRIEVE), "--sparse-segment", "512",
        "--sparse-cache-rows", "65536"]  # a step's retrieved pages fit: later steps hit
FACTS = ("Alice keeps her bicycle in the red barn. ", "The library opens at nine in the morning. ",
         "Tom planted three apple trees last spring. ", "The river freezes every January. ",
         "Maria bakes bread on Sundays. ", "The old clock in the hall stopped at noon. ")


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


@pytest.fixture(scope="module")
def dense(request, default_model_dir):
    return start_server(["--max-total-tokens", str(POOL), "--log-level", "warning", "--dtype", "float32"], request)


def text_prompt(tok, sentences: int, question: str) -> list[int]:
    body = "".join(FACTS[i % len(FACTS)] for i in range(sentences))
    text = tok.apply_chat_template([{"role": "user", "content": body + question}], add_generation_prompt=True,
                                   tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def counters(server) -> dict:
    return sparse_stats(server)["counters"]


def test_every_cluster_retrieved_answers_like_dense(server, dense, tok):
    """~100 cold rows in at most RETRIEVE clusters per head: retrieval takes them all, the estimate
    is empty and decode is exact attention, computed from the host tier's rows."""
    ids = text_prompt(tok, 8, "Where does Alice keep her bicycle?")
    cold = len(ids) - SINKS - LOCAL
    assert 0 < -(-cold // TPC) <= RETRIEVE
    before = counters(server)
    out = greedy(server, ids, 12)
    after = counters(server)
    assert after["retro_indexed_requests"] == before.get("retro_indexed_requests", 0) + 1
    assert after["retro_rows_offloaded"] - before.get("retro_rows_offloaded", 0) == cold
    assert out["output_ids"] == greedy(dense, ids, 12)["output_ids"]


def test_estimation_stays_close_to_dense(server, dense, tok):
    """About 600 cold rows, 16 of about 75 clusters retrieved per head, the rest estimated."""
    ids = text_prompt(tok, 70, "What does Maria do on Sundays?")
    assert len(ids) > SINKS + LOCAL + 4 * RETRIEVE * TPC
    mine, ref = greedy(server, ids, 16)["output_ids"], greedy(dense, ids, 16)["output_ids"]
    same = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(ref))
    assert same >= 8, (tok.decode(mine), tok.decode(ref))


def test_cold_rows_live_in_the_host_tier_and_everything_comes_back(server, tok):
    base = sparse_stats(server)
    assert base["kv_free_slots"] == base["kv_total_slots"] == POOL  # radix cache off: nothing cached
    assert base["host_bytes_used"] == 0 and base["host_bytes_total"] == 4096 * 2 ** 20
    ids = text_prompt(tok, 120, "What does Tom plant?")
    cold, new = len(ids) - SINKS - LOCAL, 40
    seen, done = [], threading.Event()

    def watch():  # the first /sparse/stats that shows the request's host rows
        while not done.is_set() and not seen:
            s = sparse_stats(server)
            if s["host_bytes_used"]:
                seen.append(s)
            time.sleep(0.05)

    def ask():
        try:
            return greedy(server, ids, new)
        finally:
            done.set()

    run_together(server, [ask, watch])
    assert seen, "no /sparse/stats showed host bytes while the request ran"
    during = seen[0]
    host = LAYERS * 2 * cold * KV_HEADS * HEAD_DIM * 4  # float32 K and V of every cold row
    assert during["host_bytes_used"] == host, during
    # device: the request's resident rows (sinks, local window, tokens so far) and the index and
    # cached clusters, well below a dense request's prompt rows
    assert POOL - during["kv_free_slots"] <= SINKS + LOCAL + new
    assert during["kv_bytes_used"] < len(ids) * during["kv_bytes_per_slot"]
    cache = during["tiers"]["device_cache"]
    assert cache["misses"] > 0 and cache["bytes_used"] <= cache["bytes_total"]
    after_hits = sparse_stats(server)["tiers"]["device_cache"]["hits"]
    assert after_hits > 0  # later decode steps read pages copied by earlier ones
    after = sparse_stats(server)
    assert after["kv_free_slots"] == POOL and after["integrity"]["ok"]
    assert after["host_bytes_used"] == 0 and after["tiers"]["host_bytes_peak"] >= host
    assert after["tiers"]["device_cache"]["bytes_used"] == 0 and after["tiers"]["index_bytes"] == 0
    assert after["kv_bytes_used"] == 0
    for _ in range(50):  # the gauge is refreshed when the scheduler goes idle
        lines = {line.split(" ")[0]: float(line.split(" ")[1])
                 for line in requests.get(server.base_url + "/metrics", timeout=60).text.splitlines()
                 if line.startswith("sglang_sparse:host_bytes")}
        if lines.get('sglang_sparse:host_bytes{kind="used"}') == 0:
            break
        time.sleep(0.2)
    assert lines['sglang_sparse:host_bytes{kind="total"}'] == 4096 * 2 ** 20
    assert lines['sglang_sparse:host_bytes{kind="used"}'] == 0


def test_a_bad_retroinfer_flag_is_refused_at_start(request):
    from sglang_sparse.server_process import ServerStartError

    with pytest.raises(ServerStartError) as err:
        start_server(["--sparse-method", "retroinfer", "--sparse-tokens-per-cluster", "64", "--sparse-segment", "32"],
                     request, timeout=120)
    assert "sglang_sparse: error: tokens_per_cluster=64 must be at most segment=32" in str(err.value)
