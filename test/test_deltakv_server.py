"""DeltaKV through the real server (CPU, default model, ``--dtype float32``), one server, with the
full-width compressor (``--sparse-latent 384`` = 2 x 3 KV heads x 64: the fitted basis uncut, so
``up(down(kv) - down(base)) + base`` gives back kv up to fp32 rounding) and references every 16
tokens. Everything else is the real path: rows un-rotated with the model's RoPE table when they
move, fathers searched over the request's references, codes written, blocks reconstructed and
rotated at ``jG + o`` for decode (``kernels.quantized.deltakv_decode``) and for prefill chunks over a
stored history (``prefix_kv``). So the server must give back HF transformers' greedy tokens (the
dense model), with log-probabilities within ``LOGPROB_TOL``:

- a first request whose prompt and decode move groups into blocks;
- a Chain Cache continuation whose prefill attends the chain's reconstructed blocks;
- a radix-cache hit that starts a new request on the finished request's blocks (``cached_tokens``
  in whole blocks).

Then every slot and block comes back after the chains go and ``/flush_cache``; ``/sparse/info``
lists the method; bad flags stop the launcher with a sentence naming the flag. The lossy default
(latent 64) serving many requests: ``test_deltakv_capacity_server.py``; the fathers, codes and
reconstruction against independent definitions: ``test_deltakv_core.py``."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from conftest import start_server
from payload_flow import blocks_chains_and_radix, stats


G, R, WIDTH = 32, 32, 384
ARGS = ["--dtype", "float32", "--max-total-tokens", "6144", "--chunked-prefill-size", "256", "--log-level", "warning",
        "--sparse-method", "deltakv", "--sparse-latent", str(WIDTH), "--sparse-stride", "16",
        "--sparse-group", str(G), "--sparse-residual", str(R), "--sparse-fp-fraction", "0.5"]
LAYERS = 30
LOGPROB_TOL = 2e-4  # a block rotated one position off, or a wrong block order, is far above this


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(ARGS, request)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def test_deltakv_equals_the_model_through_blocks_chains_and_the_radix_cache(server, hf, tok):
    idle = stats(server)
    # fp32: codes of 384 + 4 int32 fathers + a 384-wide reference every 16 tokens, per layer
    assert idle["kv_bytes_per_token"] == LAYERS * (WIDTH * 4 + 4 * 4 + WIDTH * 4 / 16)
    assert idle["method_static_bytes"] == LAYERS * (2 * WIDTH * WIDTH + WIDTH) * 4  # down, up, b_up
    blocks_chains_and_radix(server, hf, tok, "deltakv", G, R, LOGPROB_TOL)


def test_info_lists_the_method(server):
    info = requests.get(server.base_url + "/sparse/info", timeout=60).json()
    assert info["config"]["method"] == "deltakv"
    assert info["config"]["options"] == {"latent": WIDTH, "stride": 16, "neighbors": 4, "metric": "l2", "group": G,
                                         "residual": R, "fp_fraction": 0.5}
    assert info["config"]["artifacts"]["deltakv_compressor"].endswith(".safetensors")
    (scheduler,) = info["schedulers"]
    assert "hook:payload-pool-size-tokens" in scheduler["registrations"]
    assert "hook:latent-projection" not in scheduler["registrations"]  # DeltaKV leaves the model's projections


def _sentence(argv):
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
    dk = ["--sparse-method", "deltakv"]
    assert "stride=24 must divide group=32" in _sentence([*dk, "--sparse-stride", "24"])
    assert "neighbors=17 is out of range" in _sentence([*dk, "--sparse-neighbors", "17"])
    assert "metric='hamming' is not allowed" in _sentence([*dk, "--sparse-metric", "hamming"])
    assert "latent=385 is too large: must be at most 2 x 3 KV heads x 64 = 384" in _sentence(
        [*dk, "--sparse-latent", "385", *model])
    assert "tensor parallelism 2 is not supported" in _sentence([*dk, "--tp-size", "2", *model])
    assert "--kv-cache-dtype fp8_e4m3" in _sentence([*dk, "--kv-cache-dtype", "fp8_e4m3", *model])
    assert "sparse method 'deltakv' has no option ratio" in _sentence([*dk, "--sparse-ratio", "0.5"])


def test_deltakv_decodes_eagerly_on_a_gpu(monkeypatch):
    from sglang_sparse.srt.launcher import sparse_config

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    config, argv = sparse_config(["--device", "cuda", "--sparse-method", "deltakv"], log=lambda m: None)
    assert "--disable-cuda-graph" in argv and config["chain_cache"] is True and config["unit_cache"] is True
