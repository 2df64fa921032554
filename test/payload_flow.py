"""The request flow every method with a block payload (Palu, DeltaKV) is checked through, on one
server against an HF model that computes what the server should: a first request whose prompt and
decode move groups into blocks, a Chain Cache continuation that attends the chain's blocks, a
radix-cache hit that starts a new request on the finished one's blocks, then every slot and block
back after the chains go and ``/flush_cache``. Greedy tokens must equal the model's and their
log-probabilities agree to ``tol`` (a token-level check alone misses small errors, e.g. a block
read one position off)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import requests
import torch

from conftest import free_and_used, hf_argmax

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import QUESTION  # noqa: E402
from test_kivi_chain_server import turns  # noqa: E402


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def gen(server, ids, n, chain_id=None):
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id is not None:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(server.base_url + "/generate", timeout=900,
                         json={"input_ids": ids, "sampling_params": sp, "return_logprob": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def assert_same_as_the_model(hf, ids, out, n, tol):
    assert out["output_ids"] == hf_argmax(hf, ids, n)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out["output_ids"]])).logits[0, len(ids) - 1: -1].double()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    diff = float((got - want).abs().max())
    assert diff < tol, diff


def tree_units(s) -> int:
    return s["radix"]["evictable_units"] + s["radix"]["protected_units"]


def radix_hit_prompt(tok, first: list[int]) -> tuple[list[int], list[int]]:
    """(the context of ``turns``' first prompt without its closing words, a new prompt that asks
    the needle question right after that context): a request without a chain that shares the
    finished request's context, so it can start on the radix tree's blocks."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tail = enc("\n\nRead this text.<|im_end|>\n<|im_start|>assistant\n")
    context = first[: len(first) - len(tail)]
    return context, context + enc(f"\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")


def blocks_chains_and_radix(server, hf, tok, method: str, group: int, residual: int, tol: float,
                            check_first: Callable[[dict], None] | None = None) -> None:
    """The flow above for ``method`` (its counters are ``<method>_blocks_written`` and
    ``<method>_store_full``), blocks of ``group`` tokens behind a ``residual`` window;
    ``check_first`` gets ``/sparse/stats`` after the first request."""
    idle = stats(server)
    first, second = turns(tok)  # ~1K essay tokens with a needle; then a question
    out1 = gen(server, first, 40)
    assert_same_as_the_model(hf, first, out1, 40, tol)  # blocks after the prompt and while decoding
    s1 = stats(server)
    assert s1["counters"][f"{method}_blocks_written"] >= (len(first) + 40 - residual - group) // group
    if check_first is not None:
        check_first(s1)
    cid = out1["meta_info"]["chain_id"]

    # Chain Cache: the continuation resumes the blocks and attends them reconstructed
    prompt2 = first + out1["output_ids"] + second
    out2 = gen(server, prompt2, 24, chain_id=cid)
    m2 = out2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"]) == (cid, "resumed")
    assert m2["reused_tokens"] == len(first) + 40 - 1
    written = stats(server)["counters"][f"{method}_blocks_written"] - s1["counters"][f"{method}_blocks_written"]
    assert written * group <= len(prompt2) - m2["reused_tokens"] + 24 + group, written  # history not re-written
    assert_same_as_the_model(hf, prompt2, out2, 24, tol)

    # radix cache: a new request (no chain) on the same context starts on the cached blocks
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 200
    assert tree_units(stats(server)) >= (len(first) + 40 - residual - group) // group
    context, prompt3 = radix_hit_prompt(tok, first)
    out3 = gen(server, prompt3, 16)
    assert out3["meta_info"]["cached_tokens"] == len(context) // group * group > 0
    assert_same_as_the_model(hf, prompt3, out3, 16, tol)

    # everything back: chains deleted, the tree's blocks flushed
    assert requests.delete(f"{server.base_url}/chain/{out3['meta_info']['chain_id']}", timeout=60).status_code == 200
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert tree_units(done) == 0 and done["integrity"]["ok"]
    assert free_and_used(done) == free_and_used(idle)
    assert done["counters"].get(f"{method}_store_full", 0) == 0
