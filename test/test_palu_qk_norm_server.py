"""Palu on a model with a per-head ``k_norm`` between the K projection and RoPE (Qwen3), through the
real server on the CPU: a 2-layer Qwen3 of the shape below, weights from SGLang's
``--load-format dummy`` (no checkpoint: the factors are a plain SVD of the weights SGLang
initialised, taken by the projection hook once they are loaded), the default model's tokenizer.

The pool holds ``RoPE(gain * (h B) / rms(h B))``. The store recovers latents and reconstructs keys
with ``B diag(gain)`` (``PaluFactors.with_key_gain``); ``palu_residual_ppm_max`` is the largest
relative distance of a moved row from that span: a few ppm in fp32 with the gain folded, about
1e6 ppm (rows as far from the span as they are long) without it. Values, bytes per token and the
accounting are Palu's as on the default model; the launcher's refusals (grouped factors on a
k_norm model, whitening without a checkpoint) are in ``test_palu_server.py``."""

from __future__ import annotations

import json
import shutil

import pytest
import requests

from conftest import start_server

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 2, 4, 2, 64, 256
RATIO, G, R = 0.5, 16, 16
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": HIDDEN,
         "intermediate_size": 512, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
         "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 4096,
         "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "vocab_size": 49152, "tie_word_embeddings": True,
         "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32", "bos_token_id": 1,
         "eos_token_id": 2}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, default_model_dir):
    d = tmp_path_factory.mktemp("qwen3-tiny")
    (d / "config.json").write_text(json.dumps(QWEN3))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, d / name)
    return d


@pytest.fixture(scope="module")
def server(request, qwen3_dir):
    return start_server(["--model-path", str(qwen3_dir), "--load-format", "dummy", "--dtype", "float32",
                         "--max-total-tokens", "4096", "--chunked-prefill-size", "256", "--log-level", "warning",
                         "--sparse-method", "palu", "--sparse-ratio", str(RATIO), "--sparse-whiten", "off",
                         "--sparse-group", str(G), "--sparse-residual", str(R), "--sparse-fp-fraction", "0.5"],
                        request)


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def test_qwen3_keys_after_k_norm_stay_in_the_span_the_store_uses(server):
    s0 = stats(server)
    rank = round((1 - RATIO) * HEAD_DIM)
    assert s0["kv_bytes_per_token"] == LAYERS * 2 * KV_HEADS * rank * 4  # fp32 latents
    ids = [100 + (37 * j) % 20000 for j in range(300)]
    sp = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    out = requests.post(server.base_url + "/generate", json={"input_ids": ids, "sampling_params": sp},
                        timeout=600)
    assert out.status_code == 200, out.text
    assert len(out.json()["output_ids"]) == 24
    c = stats(server)["counters"]
    assert c["palu_blocks_written"] >= (300 + 24 - R - G) // G, c
    assert c["palu_residual_ppm_max"] < 1000, c  # ~1e6 if the store ignored the k_norm gain
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    idle = stats(server)
    assert idle["running_requests"] == 0
    assert idle["kv_free_slots"] + idle["chain_idle_rows"] == idle["kv_total_slots"]

