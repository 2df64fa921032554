"""KIVI through the real server (CPU): a 2K-token request's history is quantized to 2 bits after
its prompt and while it decodes; counted in bytes (residual slots, codes, fp16 scales and mins),
it is stored in at most a fifth of the bytes of the model's bf16 KV (groups of 64, a residual
of 32 to 95 tokens; with the default groups of 32 and residual 128 the ratio is 5.3 only far
beyond the residual, see docs/kv_payload.md); decoding continues through
the quantized history; every slot and block comes back once its chain is deleted and the radix
cache (which keeps the finished request's blocks) is flushed (Chain Cache and the radix cache's
reuse: ``test_kivi_chain_server.py``)."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from conftest import start_server

PROMPT, NEW, G, R = 2048, 24, 64, 32
POOL = 8192  # tokens of the model's bf16 KV: half stays SGLang's slots, half is the block store
ARGS = ["--max-total-tokens", str(POOL), "--chunked-prefill-size", "1024", "--log-level", "warning",
        "--sparse-method", "kivi", "--sparse-bits", "2", "--sparse-group", str(G), "--sparse-residual", str(R),
        "--sparse-fp-fraction", "0.5"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def test_two_bit_history_takes_a_fifth_of_the_bf16_bytes(server):
    idle = stats(server)
    per_bf16 = idle["kv_bytes_per_slot"]  # the engine pool: the model's bf16 KV
    assert idle["kv_bytes_per_token"] * 5 < per_bf16  # the quantized representation, per token
    # the pool SGLang sized is the store: half its bytes as slots, the other half as blocks
    assert idle["kv_total_slots"] == POOL // 2
    block = idle["kv_bytes_per_token"] * G
    assert POOL * per_bf16 - block < idle["kv_bytes_total"] <= POOL * per_bf16
    ids = [1000 + (7 * j) % 20000 for j in range(PROMPT)]
    out, samples = {}, []

    def run():
        out["resp"] = requests.post(server.base_url + "/generate", timeout=1800, json={
            "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}})

    t = threading.Thread(target=run)
    t.start()
    while t.is_alive():
        s = stats(server)
        if s["running_requests"] and s["counters"].get("kivi_blocks_written"):
            samples.append(s)
        time.sleep(0.2)
    t.join()
    assert out["resp"].status_code == 200, out["resp"].text
    assert len(out["resp"].json()["output_ids"]) == NEW
    assert samples, "no sample while the request decoded"
    for s in samples:
        used = s["kv_bytes_used"] - idle["kv_bytes_used"]  # residual slots + blocks of this request
        assert used * 5 <= s["logical_tokens"] * per_bf16, (used, s["logical_tokens"])
        assert s["integrity"]["ok"]
    parked = stats(server)  # the finished request's chain holds its residual rows and blocks
    assert parked["counters"]["kivi_blocks_written"] >= (PROMPT + NEW - R - G) // G
    assert parked["kv_bytes_used"] > idle["kv_bytes_used"]
    cid = out["resp"].json()["meta_info"]["chain_id"]
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 200
    done = stats(server)
    cached = done["radix"]["evictable_units"]  # the finished request's blocks, kept for reuse
    assert cached >= (PROMPT + NEW - R - G) // G and done["radix"]["protected_units"] == 0
    assert done["kv_free_slots"] == idle["kv_free_slots"]
    assert done["kv_bytes_used"] - cached * done["radix"]["unit_bytes"] == idle["kv_bytes_used"]
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    flushed = stats(server)
    assert flushed["radix"]["evictable_units"] == 0 and flushed["kv_bytes_used"] <= idle["kv_bytes_used"]


def test_chain_and_radix_cache_are_on_by_default_for_kivi():
    from sglang_sparse.srt.launcher import sparse_config

    config, _ = sparse_config(["--device", "cpu", "--sparse-method", "kivi"], log=lambda m: None)
    assert config["chain_cache"] is True and config["unit_cache"] is True
    off, _ = sparse_config(["--device", "cpu", "--sparse-method", "kivi", "--disable-radix-cache"], log=lambda m: None)
    assert off["unit_cache"] is False


def test_prune_answers_409_with_a_sentence(server):
    """The radix cache holds KIVI's quantized blocks, which have no rows to prune: a 409 that says why."""
    ids = list(range(1000, 1400))
    resp = requests.post(server.base_url + "/prune", timeout=60,
                         json={"token_ids": ids, "ranges": [[100, 300]], "keep_ratio": 0.5, "wait": True})
    assert resp.status_code == 409, resp.text
    assert "quantized blocks" in resp.text and "cannot prune" in resp.text
