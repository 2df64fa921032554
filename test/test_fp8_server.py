"""FP8 KV through the real server (CPU): the pool is SGLang's fp8 e4m3 store (the launcher adds
``--kv-cache-dtype fp8_e4m3``), so a token takes half the bytes of the model's bf16 KV and the
same bytes hold twice the tokens; requests decode, a radix-cached fp8 prefix is reused by a later
request, and every slot is accounted for."""

from __future__ import annotations

import json

import pytest
import requests

from conftest import assert_every_slot_owned_once, start_server

POOL = 2048
ARGS = ["--max-total-tokens", str(POOL), "--log-level", "warning", "--sparse-method", "fp8"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def test_fp8_pool_holds_twice_the_tokens_of_bf16_in_the_same_bytes(server, default_model_dir):
    from sglang_sparse.core.kv_budget import kv_bytes_per_token

    config = json.loads((default_model_dir / "config.json").read_text())
    bf16 = kv_bytes_per_token(config, "bfloat16")  # the KV dtype SGLang serves this model with on the CPU
    s = stats(server)
    assert s["method"] == "fp8" and s["kv_bytes_per_token"] * 2 == bf16
    assert s["kv_bytes_total"] // bf16 * 2 == s["kv_total_slots"]  # twice the tokens in those bytes


def test_fp8_requests_decode_and_reuse_a_cached_prefix(server):
    prefix = [1000 + (7 * j) % 20000 for j in range(400)]
    body = {"input_ids": prefix, "sampling_params": {"temperature": 0, "max_new_tokens": 8}}
    first = requests.post(server.base_url + "/generate", json=body, timeout=600).json()
    assert len(first["output_ids"]) >= 1
    body["input_ids"] = prefix + [5, 6, 7]
    second = requests.post(server.base_url + "/generate", json=body, timeout=600).json()
    assert second["meta_info"]["cached_tokens"] >= 400  # the fp8 prefix came from the radix cache
    assert_every_slot_owned_once(server)
