"""TurboQuant through the real server (CPU, default model, 4 bits): bytes per token follow the
layout (codes + an fp16 norm per token, head and K/V) and are a fraction of the model's KV; a
turn's history is quantized into blocks after its prompt, a chain continuation resumes the
quantized history and finds a needle that lies only in it (its prefill attends the dequantized
blocks), decode reads the codes with rotated queries; every slot and block comes back when the
chains go and the radix cache is flushed. The quantizer's formulas and the decode over blocks
are checked against their references in ``test_turboquant_core.py`` / ``test_turboquant_method.py``."""

from __future__ import annotations

import pytest
import requests

from conftest import free_and_used, start_server
from test_kivi_chain_server import KEYS, gen, turns

G, R, BITS = 32, 32, 4
ARGS = ["--max-total-tokens", "6144", "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "turboquant", "--sparse-bits", str(BITS), "--sparse-group", str(G),
        "--sparse-residual", str(R), "--sparse-fp-fraction", "0.8"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def test_quantized_history_resumes_across_turns_and_keeps_the_needle(server, tok):
    idle = stats(server)
    layers, heads, d = 30, 3, 64  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert idle["kv_bytes_per_token"] == layers * heads * 2 * (d * BITS // 8 + 2)
    assert idle["kv_bytes_per_token"] * 3.5 < idle["kv_bytes_per_slot"]  # vs the model's own KV per token
    first, second = turns(tok)
    out1 = gen(server, first, 4)
    cid = out1["meta_info"]["chain_id"]
    written1 = stats(server)["counters"]["turboquant_blocks_written"]
    assert written1 >= (len(first) - R - G) // G
    prompt2 = first + out1["output_ids"] + second
    out2 = gen(server, prompt2, 32, chain_id=cid)
    m2 = out2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"]) == (cid, "resumed")
    assert m2["reused_tokens"] == len(first) + len(out1["output_ids"]) - 1
    written2 = stats(server)["counters"]["turboquant_blocks_written"] - written1
    assert written2 * G <= len(prompt2) - m2["reused_tokens"] + 32 + G, written2  # history not re-quantized
    assert any(k in out2["text"].lower() for k in KEYS), out2["text"]
    s = stats(server)
    assert s["integrity"]["ok"] and s["counters"].get("turboquant_store_full", 0) == 0
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 200
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert free_and_used(done) == free_and_used(idle) and done["integrity"]["ok"]


def test_a_new_request_starts_on_the_radix_trees_quantized_blocks(server, tok):
    """Radix cache: a request without a chain whose prompt shares a finished one's context starts
    on the tree's quantized blocks (``cached_tokens``: the whole blocks of the shared context),
    still finds the needle that lies only in them, and the tree's blocks go back on a flush."""
    from payload_flow import radix_hit_prompt, tree_units

    idle = stats(server)
    first, _ = turns(tok)
    out1 = gen(server, first, 8)
    assert requests.delete(f"{server.base_url}/chain/{out1['meta_info']['chain_id']}", timeout=60).status_code == 200
    s1 = stats(server)
    assert tree_units(s1) >= (len(first) - R - G) // G
    context, prompt = radix_hit_prompt(tok, first)
    written = s1["counters"]["turboquant_blocks_written"]
    out = gen(server, prompt, 24)
    assert out["meta_info"]["cached_tokens"] == len(context) // G * G > 0
    assert stats(server)["counters"]["turboquant_blocks_written"] - written <= (len(prompt) - len(context) + 24) // G + 1
    assert any(k in out["text"].lower() for k in KEYS), out["text"]
    assert requests.delete(f"{server.base_url}/chain/{out['meta_info']['chain_id']}", timeout=60).status_code == 200
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert free_and_used(done) == free_and_used(idle) and done["integrity"]["ok"]


def test_flags_are_launcher_sentences():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    with pytest.raises(ConfigError, match="bits=5 is not supported: must be 2, 3 or 4"):
        sparse_config(["--device", "cpu", "--sparse-method", "turboquant", "--sparse-bits", "5"], log=lambda m: None)
    config, _ = sparse_config(["--device", "cpu", "--sparse-method", "turboquant"], log=lambda m: None)
    assert config["method"] == "turboquant" and config["chain_cache"] is True
    assert config["options"]["bits"] == 3
