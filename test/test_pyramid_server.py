"""PyramidKV through the real server (CPU): per-layer budgets free each layer's own dropped rows
(at least 90% of what SnapKV at the same average budget frees on the same prompts: exactly
``prompt - budget`` slots each, test_snapkv_server.py), concurrent requests leave no slot
behind (and their engine rows serve later requests with no trace of their per-layer tables), and
a chain resumes across turns over the per-layer rows (the suffix attends them through
``LayerRowsView`` cells; decode reads them through ``CellTables``)."""

from __future__ import annotations

import threading

import pytest
import requests

from conftest import expand_ranges, start_server

BUDGET, WINDOW, POOL = 64, 8, 4096
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "128", "--log-level", "warning",
        "--sparse-method", "pyramidkv", "--sparse-budget", str(BUDGET), "--sparse-window", str(WINDOW)]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def ids(n, seed):
    return [1000 + (7 * j + 13 * seed) % 20000 for j in range(n)]


def gen(server, prompt, n, chain_id=None):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", json={"input_ids": prompt, "sampling_params": sp},
                         timeout=900)
    assert resp.status_code == 200, resp.text
    return resp.json()


def idle_rows_accounted(server):
    s = stats(server)
    assert s["running_requests"] == 0 and s["integrity"]["ok"], s["integrity"]
    assert s["kv_free_slots"] + s["chain_idle_rows"] == s["kv_total_slots"]
    return s


def short_outputs(server) -> list:
    """Prompts within the budget, one at a time (never compacted: their decode reads the slot
    table through the cells kernel with empty per-layer tables)."""
    outs = [gen(server, ids(40 + 5 * i, 50 + i), 6) for i in range(4)]
    for o in outs:  # their chains would hold rows the later tests count
        requests.delete(f"{server.base_url}/chain/{o['meta_info']['chain_id']}", timeout=60)
    return [o["output_ids"] for o in outs]


def test_per_layer_budgets_free_what_snapkv_frees_and_nothing_leaks(server):
    fresh = short_outputs(server)
    before = stats(server)
    prompts = [ids(n, seed) for seed, n in enumerate((300, 520, 777, 1000))]
    errors = []

    def run(p):
        try:
            out = gen(server, p, 8)
            for cid in [out["meta_info"].get("chain_id")]:  # free the chain: count only the requests
                requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    after = idle_rows_accounted(server)
    assert after["kv_free_slots"] == before["kv_free_slots"]  # every slot back with SGLang's allocator
    released = after["counters"]["slots_released"] - before["counters"]["slots_released"]
    snapkv_would_free = sum(len(p) - BUDGET for p in prompts)
    assert released >= 0.9 * snapkv_would_free, (released, snapkv_would_free)
    freed_bytes = released * after["kv_bytes_per_token"]
    assert freed_bytes >= 0.9 * snapkv_would_free * after["kv_bytes_per_token"]
    # the rows the compacted requests used serve new requests with no trace of their tables
    assert short_outputs(server) == fresh


def test_a_chain_resumes_over_per_layer_rows(server):
    free0 = stats(server)["kv_free_slots"]
    p1 = ids(400, 7)
    o1 = gen(server, p1, 6)
    m1 = o1["meta_info"]
    cid = m1["chain_id"]
    rec = requests.get(f"{server.base_url}/chain/{cid}", timeout=60).json()
    assert rec["status"] == "idle" and rec["processed_tokens"] == 405
    assert rec["retained_rows"] < 120  # ceil(sum of per-layer budgets / layers) + decoded rows
    assert_per_layer_map(server, cid, rec, 400, 5)
    idle_rows_accounted(server)
    p2 = p1 + o1["output_ids"] + ids(50, 8)
    o2 = gen(server, p2, 6, cid)
    m2 = o2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"], m2["reused_tokens"]) == (cid, "resumed", 405)
    assert m2["cached_tokens"] == 405 and len(o2["output_ids"]) == 6
    s = idle_rows_accounted(server)
    assert s["chain_idle_rows"] < 130
    requests.delete(f"{server.base_url}/chain/{cid}", timeout=60)
    assert idle_rows_accounted(server)["kv_free_slots"] == free0


def assert_per_layer_map(server, cid: str, rec: dict, prompt: int, tail: int):
    """The chain's retention map: one budget per layer (every KV head alike), budgets that differ
    across layers and fill the engine rows the chain holds, the window and the ``tail`` decoded
    tokens (appended to every layer after the compaction) kept everywhere."""
    r = requests.get(f"{server.base_url}/chain/{cid}/retention", timeout=60).json()
    end = prompt + tail
    assert (r["method"], r["logical_len"], r["retained_rows"]) == ("pyramidkv", end, rec["retained_rows"])
    counts = []
    for layer in r["layers"]:
        per_head = {h["kept"] for h in layer["heads"]}
        assert len(per_head) == 1, layer
        counts.append(per_head.pop())
        for h in layer["heads"]:
            kept = expand_ranges(h["ranges"])
            assert len(kept) == h["kept"] and kept == sorted(set(kept)) and 0 <= kept[0] and kept[-1] < end
            assert set(range(prompt - WINDOW, end)) <= set(kept)
    assert len(set(counts)) > 1  # the pyramid
    # K = ceil(sum of the layers' budgets / layers) engine rows hold them, then the tail's rows
    budgets, engine = [c - tail for c in counts], rec["retained_rows"] - tail
    assert (engine - 1) * len(budgets) < sum(budgets) <= engine * len(budgets)
