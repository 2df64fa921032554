"""Hostile input against real servers (CPU; dense, Quest on a paged pool and SnapKV, one server
each; Chain Cache on, metrics on, the slot census after every step): every case of issue 12 that a
client can send, then a few hundred generated requests over every field sglang_sparse's routes
read or change. Each answer is a 2xx, or a 4xx
whose JSON body names the field in a sentence (no stack trace, no file path); the scheduler
keeps serving; no KV slot is lost or owned twice, at any step."""

from __future__ import annotations

import json
import os
import shlex
import time

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings

from conftest import assert_every_slot_owned_once, start_server
from hostile_requests import any_request

POOL = 4096
# the methods under attack, one server each: dense (radix cache and pinned chains), Quest on a
# 16-slot paged pool, SnapKV evicting into chains with the radix cache off. The prompts here are a
# few dozen tokens, so the budgets are small enough to select and compact. One method instead:
# SGLANG_SPARSE_HOSTILE_METHOD="h2o --sparse-budget 40 --sparse-recent 8" (its name, then its options)
METHODS = ([os.environ["SGLANG_SPARSE_HOSTILE_METHOD"]] if os.environ.get("SGLANG_SPARSE_HOSTILE_METHOD")
           else ["dense", "quest --sparse-page-size 16 --sparse-token-budget 32",
                 "snapkv --sparse-budget 40 --sparse-window 8"])
ARGS = ["--max-total-tokens", str(POOL), "--log-level", "warning", "--chain-cache", "on", "--enable-metrics"]
EXAMPLES = int(os.environ.get("SGLANG_SPARSE_HOSTILE_EXAMPLES", "400"))


@pytest.fixture(scope="module", params=METHODS, ids=lambda m: m.split()[0])
def server(request, default_model_dir):
    srv = start_server([*ARGS, "--sparse-method", *shlex.split(request.param)], request,
                       env={"SGLANG_SPARSE_CHECK_INTEGRITY": "1"})
    srv.method = request.param.split()[0]
    return srv


def post(server, path, body, stream=False, timeout=120):
    return requests.post(server.base_url + path, json=body, timeout=timeout, stream=stream)


def message(resp) -> str:
    """The sentence of an error body in any of SGLang's shapes: ``ErrorResponse``,
    ``{"error": {"message": ...}}`` and (its /generate schema check) ``{"error": "..."}``."""
    body = resp.json()
    if "message" in body:
        return body["message"]
    error = body["error"]
    return error if isinstance(error, str) else error["message"]


def assert_clean_refusal(resp, code=400, *words):
    assert resp.status_code == code, (resp.status_code, resp.text)
    text = message(resp)
    assert "Traceback" not in resp.text and 'File "' not in resp.text and "/site-packages/" not in resp.text
    for w in words:
        assert w in text, text


def assert_serving(server):
    r = post(server, "/generate", {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


# -- prompts the scheduler used to die on -----------------------------------------------------------
@pytest.mark.parametrize("body,field", [
    ({"text": ""}, "text"),
    ({"input_ids": [1, -5, 3]}, "input_ids[1]"),
    ({"input_ids": [1, 1000000000]}, "input_ids[1]"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_prompts_that_killed_the_scheduler_are_refused(server, body, field, stream):
    resp = post(server, "/generate", {**body, "stream": stream, "sampling_params": {"max_new_tokens": 2}})
    assert_clean_refusal(resp, 400, field)
    assert resp.headers["content-type"].startswith("application/json")  # not a 200 event stream
    assert_serving(server)


def test_openai_prompt_ids_outside_the_vocabulary_are_refused(server):
    resp = post(server, "/v1/completions", {"model": "default", "prompt": [1, 49152], "max_tokens": 2})
    assert_clean_refusal(resp, 400, "[0, 49152)")
    assert_serving(server)


# -- admin routes -------------------------------------------------------------------------------------
def test_malformed_messages_and_keys_get_400_not_500(server):
    for path in ("/prune", "/prefix/inspect"):
        bad = {"messages": [{"role": "user", "content": [1, 2]}], "ranges": [[0, 4]], "keep_ratio": 0.5}
        assert_clean_refusal(post(server, path, bad), 400, "messages[0].content[0]")
        bad = {"token_ids": [1, 2, 3, 4], "ranges": [[0, 4]], "keep_ratio": 0.5, "extra_key": [1]}
        assert_clean_refusal(post(server, path, bad), 400, "extra_key", "string")
    # well-formed messages are rendered with the chat template (they used to fail inside the scheduler)
    ok = post(server, "/prefix/inspect", {"messages": [{"role": "user", "content": "Hi there"}]})
    if requests.get(server.base_url + "/get_server_info", timeout=60).json()["disable_radix_cache"]:
        assert_clean_refusal(ok, 409, "radix cache")  # methods that evict or own their payload
    else:
        assert ok.status_code == 200 and ok.json()["cached_tokens"] >= 0, ok.text


def test_wrong_types_are_refused_and_change_nothing(server):
    prompt = [1000 + j for j in range(64)]
    assert post(server, "/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}).status_code == 200
    free = stats(server)["kv_free_slots"]
    for value in ("0.5", True, [0.5], None):
        body = {"token_ids": prompt, "ranges": [[0, 32]], "keep_ratio": value, "wait": True}
        expect = "keep_ratio" if value is not None else "exactly one of keep_ratio"
        assert_clean_refusal(post(server, "/prune", body), 400, expect)
    assert stats(server)["kv_free_slots"] == free  # nothing was pruned
    resp = post(server, "/prefix/inspect", {"token_ids": [100000000000000000000000]})
    assert_clean_refusal(resp, 400, "token_ids[0]", "[0, 49152)")  # (JSON parsing reads it as 1e+23)


def test_an_oversized_admin_body_gets_413(server):
    body = b'{"text": "' + b"a" * (64 << 20) + b'", "ranges": [[0, 4]], "keep_ratio": 0.5}'
    resp = requests.post(server.base_url + "/prune", data=body, headers={"Content-Type": "application/json"},
                         timeout=300)
    assert_clean_refusal(resp, 413, "at most 67108864")
    assert_serving(server)


# -- chains ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}),
    ("/v1/completions", {"model": "default", "prompt": "Hello", "max_tokens": 3}),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
])
def test_a_streamed_unknown_chain_answers_like_a_plain_one(server, path, body):
    body = {**body, "chain_id": "chain-unknown"}
    plain = post(server, path, body)
    streamed = post(server, path, {**body, "stream": True})
    assert plain.status_code == streamed.status_code == 404, (plain.text, streamed.text)
    assert streamed.headers["content-type"].startswith("application/json")
    assert message(plain) == message(streamed) == "unknown chain 'chain-unknown'"
    assert streamed.json() == plain.json()


def test_chain_id_must_be_one_string_for_one_prompt(server):
    base = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}}
    assert_clean_refusal(post(server, "/generate", {**base, "chain_id": 5}), 400, "chain_id must be a non-empty string")
    batch = {"input_ids": [[5, 6], [7, 8]], "sampling_params": {"max_new_tokens": 2}, "chain_id": "chain-1"}
    assert_clean_refusal(post(server, "/generate", batch), 400, "a batch of 2 prompts")
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 2,
            "chain_id": "chain-1"}
    assert_clean_refusal(post(server, "/v1/chat/completions", chat), 400, "n=2")
    completion = {"model": "default", "prompt": [[5, 6], [7, 8]], "max_tokens": 2, "chain_id": "chain-1"}
    assert_clean_refusal(post(server, "/v1/completions", completion), 400, "a batch of 2 prompts")


def test_routing_errors_carry_a_sentence(server):
    """Starlette's own 404 / 405 (``{"detail": "Not Found"}``, no sentence) get one naming the path
    and the allowed methods. ``GET /prune/.``: the client drops the dot, Starlette redirects
    ``/prune/`` to POST-only ``/prune`` (found by the generated requests, 2026-12-06)."""
    resp = requests.get(server.base_url + "/prune/.", timeout=60)
    assert_clean_refusal(resp, 405, "GET", "/prune", "POST")
    assert resp.json()["detail"] == "Method Not Allowed"  # FastAPI's field is kept
    assert_clean_refusal(requests.delete(server.base_url + "/generate", timeout=60), 405, "DELETE", "/generate")
    assert_clean_refusal(requests.get(server.base_url + "/no/such/route", timeout=60), 404, "/no/such/route")


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_sampling_params_for_one_prompt(server, stream):
    # SGLang calls .get on the list of a single prompt (a 500); n > 1 turns the prompt into a batch,
    # which SGLang serves, and so does a batch of one prompt
    one = {"text": "Hello, my name is", "sampling_params": [{"max_new_tokens": 2}], "stream": stream}
    assert_clean_refusal(post(server, "/generate", one), 400, "sampling_params must be an object for a single prompt")
    ids = {"input_ids": [5, 6, 7], "sampling_params": [{}], "stream": stream}
    assert_clean_refusal(post(server, "/generate", ids), 400, "sampling_params must be an object for a single prompt")
    assert post(server, "/generate", {**one, "text": ["Hello, my name is"]}).status_code == 200
    assert post(server, "/generate", {**one, "sampling_params": [{"max_new_tokens": 2, "n": 2}],
                                      "stream": False}).status_code == 200
    assert_serving(server)


def test_empty_batches_are_refused(server):
    # SGLang indexed sampling_params[0] of an empty batch (a 500)
    body = {"text": [], "sampling_params": [], "extra_key": None}
    assert_clean_refusal(post(server, "/generate", body), 400, "text is an empty list")
    assert_serving(server)


@pytest.mark.parametrize("field,value", [("return_logprob", []), ("top_logprobs_num", [1]), ("lora_path", []),
                                         ("custom_logit_processor", []), ("bootstrap_host", [])])
def test_per_prompt_lists_must_match_the_batch(server, field, value):
    # SGLang indexes these per prompt without checking their length (an IndexError, a 500)
    body = {"input_ids": [[1000], [1001, 1002]], field: value, "sampling_params": {"max_new_tokens": 1}}
    assert_clean_refusal(post(server, "/generate", body), 400, field, "a list of 2 values")
    ok = {"input_ids": [[1000], [1001, 1002]], "return_logprob": [True, False], "sampling_params": {"max_new_tokens": 1}}
    assert post(server, "/generate", ok).status_code == 200
    assert_serving(server)


@pytest.mark.parametrize("prompt", [[[1000, 1001, 1002]], ["Hello, my name is"]])
def test_a_batch_of_one_names_a_chain_like_one_prompt(server, prompt):
    """A prompt list of one is a batch of one for SGLang (rids ``<rid>_0``): an unknown chain is a
    404 like a plain prompt's (it was a 500: the abort used the batch's list of rids)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": 2, "chain_id": "no-such-chain"}
    resp = post(server, "/v1/completions", body)
    assert_clean_refusal(resp, 404, "unknown chain")
    ids = [1000 + j for j in range(24)]
    first = post(server, "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    chain = first.json()["meta_info"]["chain_id"]
    more = {"model": "default", "prompt": [ids + first.json()["output_ids"] + [1500, 1501]], "max_tokens": 2,
            "temperature": 0, "chain_id": chain}
    resumed = post(server, "/v1/completions", more)
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["usage"]["chain_status"] == "resumed", resumed.json()["usage"]


def test_parallel_choices_each_report_their_chain(server):
    chat = {"model": "default", "messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 3,
            "n": 2, "temperature": 0}
    resp = post(server, "/v1/chat/completions", chat)
    if resp.status_code == 400 and "parallel samples" in message(resp):  # KVzip's probe: one sample per prompt
        pytest.skip(f"{server.method} refuses n > 1: {message(resp)}")
    usage = resp.json()["usage"]
    assert [c["index"] for c in usage["chains"]] == [0, 1] and "chain_id" not in usage
    ids = [c["chain_id"] for c in usage["chains"]]
    assert len(set(ids)) == 2
    for cid in ids:  # real chains, each resumable on its own
        assert requests.get(f"{server.base_url}/chain/{cid}", timeout=60).json()["status"] == "idle"
    # SGLang's prefix warm-up request for n > 1 starts no chain of its own
    listed = {c["chain_id"] for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]}
    newest = max(int(c.split("-")[1]) for c in listed if c.startswith("chain-"))
    assert {f"chain-{newest - 1}", f"chain-{newest}"} == set(ids)


# -- the generated suite -----------------------------------------------------------------------------------
def _check(server, method, path, body) -> int:
    try:
        resp = requests.request(method, server.base_url + path, json=body, timeout=180)
    except requests.RequestException as err:  # a dropped connection is a failure
        raise AssertionError(f"{method} {path} {json.dumps(body)[:300]}: {err!r}") from None
    where = f"{method} {path} {json.dumps(body)[:300]} -> {resp.status_code} {resp.text[:300]}"
    assert resp.status_code < 500, where
    assert "Traceback" not in resp.text and 'File "' not in resp.text, where
    if resp.status_code >= 400:
        assert message(resp).strip(), where
    return resp.status_code


def test_generated_hostile_requests(server):
    run_generated(server, EXAMPLES)


@pytest.mark.slow
def test_generated_hostile_requests_long(server):
    run_generated(server, 5 * EXAMPLES)


def run_generated(server, examples: int):
    seen: dict[int, int] = {}

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(any_request)
    def one(req):
        code = _check(server, *req)
        seen[code] = seen.get(code, 0) + 1

    one()
    print("status codes of the generated requests:", dict(sorted(seen.items())))
    assert sum(seen.values()) >= min(examples, 300)
    assert seen.get(200, 0) > examples // 10  # the valid half of the strategies really ran
    assert_serving(server)
    s = stats(server)
    assert s["counters"]["integrity_violations"] == 0  # the census after every step
    assert s["integrity"]["ok"], s["integrity"]


def test_the_pool_is_whole_again_and_metrics_say_so(server):
    for c in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]:
        requests.delete(f"{server.base_url}/chain/{c['chain_id']}", timeout=60)
    assert requests.post(server.base_url + "/flush_cache", timeout=60).status_code == 200
    s = stats(server)
    # a payload method (KIVI, ...) splits the pool's bytes: its slots are fewer than POOL
    assert s["kv_free_slots"] == s["kv_total_slots"] and 0 < s["kv_total_slots"] <= POOL
    assert_every_slot_owned_once(server)
    assert_serving(server)  # one more step: the scheduler exports the state once it is idle again
    s = stats(server)
    for _ in range(50):  # the scheduler refreshes its metrics when it goes idle, just after answering
        lines = _metrics(server)
        if lines.get('sglang_sparse:kv_slots{owner="free"}') == s["kv_free_slots"]:
            break
        time.sleep(0.2)
    assert lines['sglang_sparse:integrity_lost_slots'] == 0 and lines['sglang_sparse:integrity_owned_twice_slots'] == 0
    assert lines["sglang_sparse:integrity_violations_total"] == 0
    assert lines['sglang_sparse:kv_slots{owner="free"}'] == s["kv_free_slots"]
    assert lines['sglang_sparse:kv_slots{owner="radix_tree"}'] == s["integrity"]["tree_slots"]
    assert f'sglang_sparse:events_total{{event="compactions",method="{server.method}"}}' in lines
    assert any(k.startswith("sglang_sparse:chains{") for k in lines)


def _metrics(server) -> dict:
    text = requests.get(server.base_url + "/metrics", timeout=60).text
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
            if line.startswith("sglang_sparse:")}
