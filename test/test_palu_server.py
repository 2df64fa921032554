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

import pytest
import requests
import torch

from conftest import start_server
from payload_flow import blocks_chains_and_radix, stats


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


def test_palu_equals_the_folded_model_through_blocks_chains_and_the_radix_cache(server, hf, ratio, tok):
    idle = stats(server)
    # fp32 latents of rank (1 - ratio) * 64 per KV head (full rank: as big as the row it replaces)
    assert idle["kv_bytes_per_token"] == LAYERS * 2 * KV_HEADS * round((1 - ratio) * HEAD_DIM) * 4
    assert idle["kv_bytes_per_slot"] == LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
    blocks_chains_and_radix(server, hf, tok, "palu", G, R, LOGPROB_TOL, check_first=rows_in_span)


def rows_in_span(s) -> None:
    assert s["counters"]["palu_residual_ppm_max"] < 50, s["counters"]  # every recovered row lies in span(B)


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
