"""KIVI with Chain Cache through the real server (CPU, 4-bit): a turn's quantized history is
parked with its chain and a continuation resumes from it. The continuation does not re-quantize
the history, its prefill attends the dequantized blocks (a needle that lies only in the
quantized part is still found), and every slot and block comes back when the chain goes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests

from conftest import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import KEYS, NEEDLE, QUESTION, essays_tokens  # noqa: E402

G, R, LEN = 32, 32, 1024
ARGS = ["--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "kivi", "--sparse-bits", "4", "--sparse-group", str(G), "--sparse-residual", str(R)]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def gen(server, ids, n, chain_id=None):
    sp = {"temperature": 0, "max_new_tokens": n}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", json={"input_ids": ids, "sampling_params": sp}, timeout=900)
    assert resp.status_code == 200, resp.text
    return resp.json()


def turns(tok):
    """Turn 1: essays with the needle at the middle; turn 2 (after turn 1's output): the question."""
    hay = essays_tokens(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    head, needle = enc("<|im_start|>user\n"), enc(NEEDLE)
    tail = enc("\n\nRead this text.<|im_end|>\n<|im_start|>assistant\n")
    context = hay[: LEN - len(head) - len(tail) - len(needle)]
    cut = len(context) // 2
    period = enc(".")[0]
    while context[cut - 1] != period:
        cut -= 1
    first = head + context[:cut] + needle + context[cut:] + tail
    second = enc(f"<|im_end|>\n<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    return first, second


def test_a_continuation_resumes_the_quantized_history_and_finds_the_needle_in_it(server, tok):
    idle = stats(server)
    first, second = turns(tok)
    out1 = gen(server, first, 4)
    m1 = out1["meta_info"]
    cid = m1["chain_id"]
    parked = stats(server)
    written1 = parked["counters"]["kivi_blocks_written"]
    assert written1 >= (LEN - R - G) // G  # the prompt's history is in blocks, parked with the chain
    prompt2 = first + out1["output_ids"] + second
    out2 = gen(server, prompt2, 32, chain_id=cid)
    m2 = out2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"]) == (cid, "resumed")
    assert m2["reused_tokens"] == len(first) + len(out1["output_ids"]) - 1  # the last sampled token had no KV
    written2 = stats(server)["counters"]["kivi_blocks_written"] - written1
    # only the new tokens are quantized: the history's blocks are reused, not written again
    assert written2 * G <= len(prompt2) - m2["reused_tokens"] + 32 + G, written2
    # the needle lies in the quantized blocks only (far behind the residual window): it is found
    # because the continuation's prefill attends the dequantized history
    assert any(k in out2["text"].lower() for k in KEYS), out2["text"]
    # the same prompt without the chain (full-precision prefill, then quantized) finds it too
    fresh = gen(server, prompt2, 32)
    assert any(k in fresh["text"].lower() for k in KEYS), fresh["text"]
    assert stats(server)["counters"]["kivi_blocks_written"] - written1 - written2 >= (len(prompt2) - R - G) // G
    for c in (cid, fresh["meta_info"]["chain_id"]):
        assert requests.delete(f"{server.base_url}/chain/{c}", timeout=60).status_code == 200
    done = stats(server)
    assert done["kv_free_slots"] == idle["kv_free_slots"] and done["kv_bytes_used"] == idle["kv_bytes_used"]
    assert done["integrity"]["ok"]
