"""Palu through the real server (CPU, default model, ``--dtype float32``), at ratio 0 (full rank)
and at ratio 0.5 (rank 32 of 64 per KV head, whitened factors).

The reference is HF transformers in fp32 with the same factors folded into its K/V projection
weights (``W_k <- (A B_k)^T``, ``W_v <- (A B_v)^T``; at ratio 0 nothing is folded: the model as it
is). Every part of the server's path must give back that model's greedy tokens, with
log-probabilities within ``LOGPROB_TOL``:

- the projection hook (``qkv_proj``'s K/V replaced by ``x A B``), RoPE and the pool write;
- the recovery of latents from the rotated rows after the prompt and while decoding (blocks
  written, ``palu_residual_ppm_max`` tiny) and decode over reconstructed blocks + residual;
- a Chain Cache continuation whose prefill attends the reconstructed blocks (``prefix_kv``);
- a radix-cache hit that starts a new request on the finished request's blocks
  (``cached_tokens`` in whole blocks).

At ratio 0.5 the folded model is not the dense one (on the needle prompt its text differs), so
this also shows that the server really runs the low-rank projection (the ratio-0 case alone could
not: there it is the identity). Then every slot and block comes back after the chains go and ``/flush_cache``; ``/sparse/info``
lists the projection hook; bad flags stop the launcher with a sentence. Bytes per token at a
compression ratio: ``test_palu_capacity_server.py`` (ratio 0.75) and ``test_palu_core.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import requests
import torch

from conftest import free_and_used, hf_argmax, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))
from bench_niah import QUESTION  # noqa: E402
from test_kivi_chain_server import turns  # noqa: E402

G, R = 32, 32
ARGS = ["--dtype", "float32", "--max-total-tokens", "6144", "--chunked-prefill-size", "256", "--log-level", "warning",
        "--sparse-method", "palu", "--sparse-group", str(G), "--sparse-residual", str(R), "--sparse-fp-fraction", "0.5"]
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M
LOGPROB_TOL = 2e-4  # measured ~2e-5; a block read one position off gives ~2e-2


@pytest.fixture(scope="module", params=[0.0, 0.5], ids=["ratio0", "ratio0.5"])
def ratio(request):
    return request.param  # one server at a time: pytest finishes one ratio's tests before the next


@pytest.fixture(scope="module")
def server(request, ratio, default_model_dir):
    return start_server(ARGS + ["--sparse-ratio", str(ratio)], request)


@pytest.fixture(scope="module")
def hf(ratio, default_model_dir):
    """The model with the server's factors folded into its K/V projections (ratio 0: as it is)."""
    from transformers import AutoModelForCausalLM

    from sglang_sparse import artifacts
    from sglang_sparse.core.lowrank import PaluFactors, ranks_for_ratio
    from sglang_sparse.registry import build_config

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    if ratio == 0:
        return model
    config = build_config("palu", {"ratio": ratio})  # the server's options (whitened, head group 1)
    path = artifacts.prepare_palu(config, default_model_dir, [], lambda m: None)["palu_factors"]
    rank, _ = ranks_for_ratio(ratio, KV_HEADS, HEAD_DIM, 1)
    f = PaluFactors.from_full(artifacts.load_palu(path, LAYERS), rank, 1, HEAD_DIM)
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            half = f.a[i].shape[1] // 2
            layer.self_attn.k_proj.weight.copy_((f.a[i][:, :half] @ f.block_diag(i, "k")).t())
            layer.self_attn.v_proj.weight.copy_((f.a[i][:, half:] @ f.block_diag(i, "v")).t())
    return model


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


def assert_same_as_the_model(hf, ids, out, n, tol=LOGPROB_TOL):
    """The server's greedy tokens are HF's, and their log-probabilities agree to ``tol`` (a
    token-level check alone misses small errors, e.g. a block read one position off)."""
    assert out["output_ids"] == hf_argmax(hf, ids, n)
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out["output_ids"]])).logits[0, len(ids) - 1: -1].double()
    want = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(out["output_ids"])[:, None])[:, 0]
    got = torch.tensor([x[0] for x in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
    diff = float((got - want).abs().max())
    assert diff < tol, diff


def tree_units(s) -> int:
    return s["radix"]["evictable_units"] + s["radix"]["protected_units"]


def test_palu_equals_the_folded_model_through_blocks_chains_and_the_radix_cache(server, hf, ratio, tok):
    idle = stats(server)
    # fp32 latents of rank (1 - ratio) * 64 per KV head (full rank: as big as the row it replaces)
    assert idle["kv_bytes_per_token"] == LAYERS * 2 * KV_HEADS * round((1 - ratio) * HEAD_DIM) * 4
    assert idle["kv_bytes_per_slot"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    first, second = turns(tok)  # ~1K essay tokens with a needle; then a question
    out1 = gen(server, first, 40)
    assert_same_as_the_model(hf, first, out1, 40)  # blocks after the prompt and while decoding
    s1 = stats(server)
    assert s1["counters"]["palu_blocks_written"] >= (len(first) + 40 - R - G) // G
    assert s1["counters"]["palu_residual_ppm_max"] < 50, s1["counters"]  # rows lie in span(B)
    cid = out1["meta_info"]["chain_id"]

    # Chain Cache: the continuation resumes the latent blocks and attends them reconstructed
    prompt2 = first + out1["output_ids"] + second
    out2 = gen(server, prompt2, 24, chain_id=cid)
    m2 = out2["meta_info"]
    assert (m2["chain_id"], m2["chain_status"]) == (cid, "resumed")
    assert m2["reused_tokens"] == len(first) + 40 - 1
    written = stats(server)["counters"]["palu_blocks_written"] - s1["counters"]["palu_blocks_written"]
    assert written * G <= len(prompt2) - m2["reused_tokens"] + 24 + G, written  # history not re-written
    assert_same_as_the_model(hf, prompt2, out2, 24)

    # radix cache: a new request (no chain) on the same context starts on the cached blocks
    assert requests.delete(f"{server.base_url}/chain/{cid}", timeout=60).status_code == 200
    before = stats(server)
    assert tree_units(before) >= (len(first) + 40 - R - G) // G
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    tail = enc("\n\nRead this text.<|im_end|>\n<|im_start|>assistant\n")
    context = first[: len(first) - len(tail)]
    prompt3 = context + enc(f"\n\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    out3 = gen(server, prompt3, 16)
    assert out3["meta_info"]["cached_tokens"] == len(context) // G * G > 0
    assert_same_as_the_model(hf, prompt3, out3, 16)

    # everything back: chains deleted, the tree's blocks flushed
    assert requests.delete(f"{server.base_url}/chain/{out3['meta_info']['chain_id']}", timeout=60).status_code == 200
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    done = stats(server)
    assert tree_units(done) == 0 and done["integrity"]["ok"]
    assert free_and_used(done) == free_and_used(idle)
    assert done["counters"].get("palu_store_full", 0) == 0


def test_info_lists_the_projection_hook(server):
    info = requests.get(server.base_url + "/sparse/info", timeout=60).json()
    (scheduler,) = info["schedulers"]
    assert "hook:latent-projection" in scheduler["registrations"]
    assert "module-hook:qkv-proj" in scheduler["registrations"]
    assert "hook:payload-pool-size-tokens" in scheduler["registrations"]
    assert "hook:latent-projection" not in info["launcher"]["registrations"]  # a scheduler-side hook


def _sentence(argv, tmp_path=None):
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import method_artifacts, sparse_config

    with pytest.raises(ConfigError) as err:
        config, rest = sparse_config(["--device", "cpu", *argv], log=lambda m: None)
        method_artifacts(config, rest, log=lambda m: None)
    return str(err.value)


def test_bad_flags_stop_the_launcher_with_a_sentence(tmp_path):
    config = {"num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "hidden_size": 576, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = ["--model-path", str(tmp_path)]
    assert "ratio=1.0 is out of range: must be in [0, 1)" in _sentence(
        ["--sparse-method", "palu", "--sparse-ratio", "1"])
    assert "whiten='maybe' is not allowed" in _sentence(["--sparse-method", "palu", "--sparse-whiten", "maybe"])
    assert "head_group=2 must divide the model's 3 KV heads" in _sentence(
        ["--sparse-method", "palu", "--sparse-head-group", "2", *model])
    assert "with --tp-size 2 needs whole KV head groups on each rank: the model's 3 KV heads" in _sentence(
        ["--sparse-method", "palu", "--tp-size", "2", *model])
    assert "--kv-cache-dtype fp8_e4m3" in _sentence(["--sparse-method", "palu", "--kv-cache-dtype", "fp8_e4m3", *model])
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3"}))
    assert "--sparse-head-group 3 does not fit qwen3 models" in _sentence(
        ["--sparse-method", "palu", "--sparse-head-group", "3", *model])  # k_norm: per-head factors only
    assert "--load-format dummy has no checkpoint to calibrate: pass --sparse-whiten off" in _sentence(
        ["--sparse-method", "palu", "--load-format", "dummy", *model])


def test_the_launcher_stops_before_sglang_starts(tmp_path, monkeypatch):
    """``main`` exits with the sentence (no SGLang import, no server) on a model-dependent value."""
    from sglang_sparse.srt import launcher

    config = {"num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
              "hidden_size": 576, "model_type": "llama", "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as err:
        launcher.main(["--model-path", str(tmp_path), "--max-total-tokens", "4096", "--sparse-method", "palu",
                       "--sparse-head-group", "2"])
    assert str(err.value) == "sglang_sparse: error: head_group=2 must divide the model's 3 KV heads"


def test_cuda_graphs_follow_the_decode_kernel_on_a_gpu(monkeypatch):
    """Palu decodes through ``triton_palu`` on CUDA (no host sync): CUDA graphs stay on; a runtime
    whose decode kernel is not graph-safe gets ``--disable-cuda-graph`` from the launcher."""
    from sglang_sparse.methods.palu import PaluRuntime
    from sglang_sparse.srt.launcher import sparse_config

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    config, argv = sparse_config(["--device", "cuda", "--sparse-method", "palu"], log=lambda m: None)
    assert "--disable-cuda-graph" not in argv and config["chain_cache"] is True and config["unit_cache"] is True
    monkeypatch.setattr(PaluRuntime, "decode_kernel_graph_safe", False)
    _, argv = sparse_config(["--device", "cuda", "--sparse-method", "palu"], log=lambda m: None)
    assert "--disable-cuda-graph" in argv


def test_in_place_weight_updates_are_refused(server, default_model_dir):
    """The factors come from the starting weights: an update would leave them stale (400), and the
    server goes on serving."""
    r = requests.post(server.base_url + "/update_weights_from_disk", json={"model_path": str(default_model_dir)},
                      timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith("model_path: in-place weight updates are not supported with "
                                          "--sparse-method palu"), r.text
    r = requests.post(server.base_url + "/update_weights_from_tensor",
                      json={"serialized_named_tensors": [], "flush_cache": False}, timeout=120)
    assert r.status_code == 400 and "weights: in-place weight updates" in r.text, r.text
    out = requests.post(server.base_url + "/generate", timeout=120,
                        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}})
    assert out.status_code == 200, out.text
