"""Issue 2 end to end: the real SGLang server, started by ``python -m sglang_sparse.launch_server``
on the embedded default model (no --model-path), on the CPU. One server for the whole module."""

from __future__ import annotations

import json
import random

import pytest
import requests
import torch

from conftest import start_server
from sglang_sparse.registry import method_names

# fp32 on both sides so greedy decoding is comparable token for token.
SERVER_ARGS = ["--dtype", "float32", "--max-total-tokens", "16384", "--log-level", "warning"]
PROMPTS = [
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def server(request, default_model_dir):
    return start_server(SERVER_ARGS, request)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain greedy loop with the KV cache: argmax of the last logits, n times, no EOS stop."""
    out, past = [], None
    inp = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = model(input_ids=inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            inp = torch.tensor([[nxt]])
    return out


def generate(server, input_ids, n, **extra):
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
        **extra,
    }
    resp = requests.post(server.base_url + "/generate", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_hf_transformers(server, hf, prompt):
    tok, model = hf
    ids = tok(prompt)["input_ids"]
    got = generate(server, ids, NEW_TOKENS)
    want = hf_greedy(model, ids, NEW_TOKENS)
    assert got["output_ids"] == want, (tok.decode(got["output_ids"]), tok.decode(want))


def test_shared_prefix_is_a_radix_hit(server, hf):
    tok, _ = hf
    rng = random.Random(0)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "river", "stone"]) for _ in range(300))
    prefix = tok(f"Notes {rng.random()}: {words}")["input_ids"]
    first = generate(server, prefix + tok(" First question?")["input_ids"], 4)
    second = generate(server, prefix + tok(" Another one?")["input_ids"], 4)
    assert len(prefix) > 250
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] >= len(prefix)


def test_openai_chat_completion_uses_chat_template(server, hf):
    tok, _ = hf
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    resp = requests.post(
        server.base_url + "/v1/chat/completions",
        json={"model": "default", "messages": messages, "max_tokens": 16, "temperature": 0},
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "Paris" in body["choices"][0]["message"]["content"]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    assert body["usage"]["prompt_tokens"] == len(tok(text, add_special_tokens=False)["input_ids"])


def test_frontend_language_program(server):
    import sglang as sgl

    @sgl.function
    def capital(s, country):
        s += sgl.user(f"What is the capital of {country}?")
        s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))
        s += sgl.user("Is that city in Europe? Answer yes or no.")
        s += sgl.assistant(sgl.select("in_europe", choices=["yes", "no"]))

    backend = sgl.RuntimeEndpoint(server.base_url)
    state = capital.run(country="France", backend=backend)
    assert "Paris" in state["answer"]
    assert state["in_europe"] in ("yes", "no")


def test_plugin_registrations_happen_in_the_scheduler(server):
    info = requests.get(server.base_url + "/server_info", timeout=60).json()
    (scheduler,) = [s["sglang_sparse"] for s in info["internal_states"]]
    # This record is built inside the scheduler process and sent back over ZMQ.
    assert scheduler["pid"] != server.proc.pid
    assert scheduler["process"] != "MainProcess"
    assert "platform:cpu-rotary-plain-torch" in scheduler["registrations"]
    assert "hook:scheduler-internal-state" in scheduler["registrations"]
    assert scheduler["rope_plain_torch_path"] is True
    sparse = requests.get(server.base_url + "/sparse/info", timeout=60).json()
    assert sparse["launcher"]["pid"] == server.proc.pid
    assert "route:/sparse/info" in sparse["launcher"]["registrations"]
    assert sparse["schedulers"] == [scheduler]
    # every method of the paper's table, with its family, and the sparse prefill policy
    available = {m["name"]: m["family"] for m in sparse["available"]["methods"]}
    assert set(available) == {"dense", "quest", "omnikv", "retroinfer", "streamingllm", "snapkv", "pyramidkv",
                              "h2o", "rkv", "skipkv", "kvzip", "palu", "deltakv", "kivi", "turboquant", "fp8"}
    assert (available["quest"], available["kivi"]) == ("dynamic selection", "quantization")
    assert [p["name"] for p in sparse["available"]["prefill"]] == ["flashprefill"]


def test_failed_start_shows_the_server_traceback(tmp_path, request):
    from sglang_sparse.server_process import ServerStartError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"], "model_type": "no_such_model"}))
    with pytest.raises(ServerStartError) as err:
        start_server(["--model-path", str(tmp_path), "--max-total-tokens", "4096"], request, timeout=200)
    text = str(err.value)
    assert "Traceback (most recent call last)" in text
    assert "no_such_model" in text


def test_dense_runs_through_the_contract_and_nothing_leaks(server):
    """The default method (dense) drives the SparseController in every step, and after the cache
    is flushed every KV slot is free again."""
    stats = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    assert stats["method"] == "dense"
    assert stats["steps"] > 0  # the test module's requests went through the hooks
    assert stats["running_requests"] == 0
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    stats = requests.get(server.base_url + "/sparse/stats", timeout=60).json()
    assert stats["kv_free_slots"] == stats["kv_total_slots"]
    assert stats["logical_tokens"] == stats["retained_tokens"] == 0


def test_dense_gives_the_same_tokens_as_plain_sglang(server, default_model_dir, request):
    """The same flags on plain ``python -m sglang.launch_server`` (no sglang_sparse hooks at all)
    and on sglang_sparse with dense: identical greedy tokens, batched and alone."""
    plain = start_server(["--model-path", str(default_model_dir), "--device", "cpu", "--sleep-on-idle",
                          *SERVER_ARGS], request, module="sglang.launch_server")
    assert "sglang_sparse" not in requests.get(plain.base_url + "/server_info", timeout=60).json()[
        "internal_states"][0]  # really the baseline: the plugin's scheduler hooks are not active
    rng = random.Random(7)
    prompts = [[rng.randrange(100, 40000) for _ in range(n)] for n in (5, 120, 333)]

    def batched(srv):
        resp = requests.post(srv.base_url + "/generate", timeout=300, json={
            "input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}})
        assert resp.status_code == 200, resp.text
        return [r["output_ids"] for r in resp.json()]

    alone = [generate(plain, ids, 24)["output_ids"] for ids in prompts]
    assert [generate(server, ids, 24)["output_ids"] for ids in prompts] == alone
    assert batched(server) == batched(plain)


@pytest.mark.parametrize("flags,message", [
    (["--sparse-method", "snapkvv"], "unknown sparse method 'snapkvv'; available: " + ", ".join(method_names())),
    (["--sparse-method", "quest", "--sparse-token-budget", "4"], "token_budget=4 is out of range"),
    (["--sparse-method", "quest", "--sparse-window", "8"], "sparse method 'quest' has no option window"),
])
def test_bad_sparse_flags_are_refused_at_start(request, flags, message):
    from sglang_sparse.server_process import ServerStartError

    with pytest.raises(ServerStartError) as err:
        start_server(flags, request, timeout=120)
    assert f"sglang_sparse: error: {message}" in str(err.value)


def test_chain_id_means_the_same_for_every_method(server):
    """Dense with --chain-cache auto has no chains: a request naming one is refused with the way
    to turn them on (an evicting method would answer 404 for an unknown chain, not ignore it)."""
    for path, body in [
        ("/generate", {"text": "Hi", "chain_id": "chain-1", "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "custom_params": {"chain_id": "c"}}}),
        ("/v1/completions", {"model": "default", "prompt": "Hi", "max_tokens": 2, "chain_id": "chain-1"}),
        ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2, "chain_id": "chain-1", "stream": True}),
    ]:
        resp = requests.post(server.base_url + path, json=body, timeout=120)
        assert resp.status_code == 400, resp.text
        assert "Chain Cache is off" in resp.text and "--chain-cache on" in resp.text, resp.text
