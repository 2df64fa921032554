"""KIVI with Chain Cache through the real server (CPU, 4-bit): a turn's quantized history is
parked with its chain and a continuation resumes from it. The continuation does not re-quantize
the history, its prefill attends the dequantized blocks (a needle that lies only in the
quantized part is still found), and every slot and block comes back when the chain goes.
Admission counts blocks: requests whose blocks do not fit wait instead of falling back to full
precision. The radix cache keeps finished requests' blocks: a later request with the same
prefix prefills only the rest, attends the shared blocks, and the blocks go back to the store
when the cache is flushed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests

from conftest import free_and_used, run_together, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import KEYS, NEEDLE, QUESTION, essays_tokens  # noqa: E402

G, R, LEN = 32, 32, 1024
# a pool of 6,144 bf16 tokens' bytes: 80% stays 4,915 full-precision slots, 20% holds 122 4-bit
# blocks (3,904 tokens): blocks, not slots, are what runs out first here
ARGS = ["--max-total-tokens", "6144", "--chunked-prefill-size", "512", "--log-level", "warning",
        "--sparse-method", "kivi", "--sparse-bits", "4", "--sparse-group", str(G), "--sparse-residual", str(R),
        "--sparse-fp-fraction", "0.8"]


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def tree_units(s) -> int:
    return s["radix"]["evictable_units"] + s["radix"]["protected_units"]


def gen(server, ids, n, chain_id=None, **fields):
    sp = {"temperature": 0, "max_new_tokens": n}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    body = {"input_ids": ids, "sampling_params": sp, **fields}
    resp = requests.post(server.base_url + "/generate", json=body, timeout=900)
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
    # the same prompt without the chain (full-precision prefill, then quantized) finds it too; its
    # own extra_key keeps it off the radix cache's blocks of the two turns
    fresh = gen(server, prompt2, 32, extra_key="fresh")
    assert fresh["meta_info"]["cached_tokens"] == 0
    assert any(k in fresh["text"].lower() for k in KEYS), fresh["text"]
    assert stats(server)["counters"]["kivi_blocks_written"] - written1 - written2 >= (len(prompt2) - R - G) // G
    for c in (cid, fresh["meta_info"]["chain_id"]):
        assert requests.delete(f"{server.base_url}/chain/{c}", timeout=60).status_code == 200
    done = stats(server)
    assert free_and_used(done) == free_and_used(idle)
    assert done["integrity"]["ok"]


def test_admission_waits_for_blocks_instead_of_overfilling_the_store(server):
    """Four requests whose blocks (4 x 33) exceed the store (122) while their prompts fit the
    slots: the last waits for blocks (idle chains are reclaimed for them too), none falls back to
    full precision (``kivi_store_full``), all finish, and nothing is left once the chains go."""
    idle = stats(server)
    full0 = idle["counters"].get("kivi_store_full", 0)
    prompts = [[1000 + (13 * j + 101 * i) % 20000 for j in range(1100)] for i in range(4)]
    outs, _ = run_together(server, [lambda p=p: gen(server, p, 16) for p in prompts])
    s = stats(server)
    assert all(o is not None and len(o["output_ids"]) == 16 for o in outs)
    assert s["counters"].get("kivi_store_full", 0) == full0
    assert s["counters"].get("store_admission_waits", 0) > 0
    for o in outs:  # chains not reclaimed on the way are still idle: delete them
        requests.delete(f"{server.base_url}/chain/{o['meta_info']['chain_id']}", timeout=60)
    done = stats(server)
    assert free_and_used(done) == free_and_used(idle)
    assert done["integrity"]["ok"]


def test_a_later_request_reuses_cached_blocks_of_a_shared_prefix(server, tok):
    """The needle essay, then a new request (no chain) with the same context and the question:
    its prompt's whole blocks come from the radix cache (``cached_tokens``, block aligned), it
    writes blocks only for its own part, it finds the needle that lies only in the shared blocks,
    and a flush gives every block back."""
    idle = stats(server)
    first, _ = turns(tok)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tail = enc("\n\nRead this text.<|im_end|>\n<|im_start|>assistant\n")
    context = first[: len(first) - len(tail)]
    out1 = gen(server, first, 4)
    after1 = stats(server)
    cached_blocks = tree_units(after1) - tree_units(idle)
    assert cached_blocks >= (len(first) - R - G) // G  # the finished request's blocks are in the tree
    assert after1["radix"]["unit_tokens"] == G and after1["radix"]["evictable_units"] >= cached_blocks
    ask = enc(f"\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    out2 = gen(server, context + ask, 32)
    m2 = out2["meta_info"]
    assert m2["cached_tokens"] == len(context) // G * G, (m2["cached_tokens"], len(context))
    written = stats(server)["counters"]["kivi_blocks_written"] - after1["counters"]["kivi_blocks_written"]
    assert written * G <= len(ask) + 32 + (len(context) % G) + G, written  # only its own tokens
    assert any(k in out2["text"].lower() for k in KEYS), out2["text"]
    for o in (out1, out2):
        assert requests.delete(f"{server.base_url}/chain/{o['meta_info']['chain_id']}", timeout=60).status_code == 200
    # /prune refuses the quantized prefix with a sentence; a flush gives the tree's blocks back
    r = requests.post(server.base_url + "/prune", json={"token_ids": context, "ranges": [[0, 64]], "keep_ratio": 0.5, "wait": True}, timeout=60)
    assert r.status_code == 409 and "quantized blocks" in r.text, r.text
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert tree_units(done) == 0 and done["radix"]["nodes"] == 0
    assert free_and_used(done) == free_and_used(idle)
    assert done["integrity"]["ok"]
