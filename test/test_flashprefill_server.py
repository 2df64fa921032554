"""FlashPrefill through the real server (CPU, default model): ``--sparse-prefill flashprefill``
composes with a decode method and routes prefill chunks through the block mask.

- keep-all (threshold 1.0), 16-position blocks, 128-token prefill chunks, dense decode: the
  greedy tokens of an essay prompt equal HF transformers' on the whole prompt (every chunk after
  the first attends its earlier rows through the block-sparse path), every causal block counted as
  kept, the pool whole afterwards;
- threshold 0.5 with Quest decoding: the chunks of a long prompt keep fewer blocks than the causal
  mask holds, Quest still selects pages while decoding, a prompt under ``min_len`` stays dense, and
  every slot comes back.
The mask and the attention over it are checked against their definitions in
``test_flashprefill_kernels.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests
import torch

from conftest import greedy, hf_argmax, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import essays_tokens  # noqa: E402

BASE = ["--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "128",
        "--log-level", "warning", "--chain-cache", "off", "--sparse-prefill", "flashprefill",
        "--sparse-prefill-block", "16"]
N = 8


@pytest.fixture(scope="module")
def tok(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def delta(after, before, key):
    return after["counters"].get(key, 0) - before["counters"].get(key, 0)


def test_keep_all_equals_hf_through_the_block_sparse_path(request, default_model_dir, tok):
    srv = start_server(BASE + ["--sparse-prefill-threshold", "1.0", "--sparse-prefill-min-len", "0"], request)
    ids = essays_tokens(tok)[:600]
    before = stats(srv)
    out = greedy(srv, ids, N)
    after = stats(srv)
    assert out["output_ids"] == hf_argmax(hf_model(default_model_dir), ids, N)
    layers = 30
    assert delta(after, before, "prefill_sparse_chunks") == layers * -(-600 // 128)
    kept, total = delta(after, before, "prefill_blocks_kept"), delta(after, before, "prefill_blocks_total")
    blocks = -(-600 // 16)
    assert kept == total == layers * 9 * blocks * (blocks + 1) // 2  # 9 query heads, every causal pair
    assert requests.post(srv.base_url + "/flush_cache", timeout=60).status_code == 200
    s = stats(srv)
    assert s["kv_free_slots"] == s["kv_total_slots"] and s["integrity"]["ok"]
    srv.stop()


def test_sparse_chunks_compose_with_quest_and_short_prompts_stay_dense(request, tok):
    srv = start_server(BASE + ["--sparse-method", "quest", "--sparse-token-budget", "128",
                               "--sparse-prefill-threshold", "0.5", "--sparse-prefill-min-len", "256",
                               "--disable-radix-cache"], request)
    ids = essays_tokens(tok)[:1500]
    before = stats(srv)
    out = greedy(srv, ids, N)
    assert len(out["output_ids"]) == N
    after = stats(srv)
    kept, total = delta(after, before, "prefill_blocks_kept"), delta(after, before, "prefill_blocks_total")
    assert 0 < kept < total, (kept, total)
    # chunks of 128: those whose keys (earlier rows + chunk) reach 256 are sparse, the first is dense
    assert delta(after, before, "prefill_sparse_chunks") == 30 * (-(-1500 // 128) - 1)
    assert delta(after, before, "prefill_dense_chunks") == 30
    assert delta(after, before, "pages_selected") > 0  # Quest decoded the request
    short = greedy(srv, ids[:100], 2)
    assert len(short["output_ids"]) == 2
    end = stats(srv)
    assert delta(end, after, "prefill_sparse_chunks") == 0 and delta(end, after, "prefill_dense_chunks") == 30
    assert end["kv_free_slots"] == end["kv_total_slots"] and end["integrity"]["ok"]
    srv.stop()


def test_flags_are_launcher_sentences():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    quiet = {"log": lambda m: None}
    with pytest.raises(ConfigError, match="must be a power of two >= 16"):
        sparse_config(["--device", "cpu", "--sparse-prefill", "flashprefill", "--sparse-prefill-block", "24"], **quiet)
    with pytest.raises(ConfigError, match=r"threshold 0.0 is out of range: must be in \(0, 1\]"):
        sparse_config(["--device", "cpu", "--sparse-prefill", "flashprefill", "--sparse-prefill-threshold", "0"],
                      **quiet)
    with pytest.raises(ConfigError, match="given without --sparse-prefill"):
        sparse_config(["--device", "cpu", "--sparse-prefill-block", "32"], **quiet)
    with pytest.raises(ConfigError, match="unknown --sparse-prefill 'nope'"):
        sparse_config(["--device", "cpu", "--sparse-prefill", "nope"], **quiet)
    with pytest.raises(ConfigError, match="--sparse-prefill flashprefill needs --attention-backend"):
        sparse_config(["--device", "cpu", "--sparse-prefill", "flashprefill", "--attention-backend", "flashinfer"],
                      **quiet)
    config, argv = sparse_config(["--device", "cpu", "--sparse-prefill", "flashprefill"], **quiet)
    assert config["prefill"] == {"name": "flashprefill", "options": {
        "block": 64, "threshold": 0.9, "budget": 0, "sinks": 1, "local": 2, "min_len": 4096}}
    assert argv[argv.index("--attention-backend") + 1] == "torch_native"
