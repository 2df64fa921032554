"""KVzip through the real server (CPU, default model, fp32): the engine prefills the prompt's
context + the reconstruction probe, the compaction drops the probe's rows, and the prompt's last
token is fed at its own logical position as the first decode input (api/probe.py,
engine/probe.py). Keep ratio 1.0 keeps every context row, so greedy output equals plain HF greedy
on the client's prompt; the probe rows are released (exact slot accounting, no leak); the
retention map of a running request holds exactly the logical positions ``[0, prompt + decoded)``
(no probe position); streaming and the OpenAI route see only generated tokens; errors are 400
sentences. Chain Cache (on by default): a continuation resumes the parked rows, prefills only its
new tokens and a probe of its new context; at keep ratio 1 every turn's output equals HF greedy
on the whole conversation. A second server at keep ratio 0.3 keeps, per layer and KV head, exactly the positions of the
plain-torch reference (``kvzip_probe_scores`` / ``kvzip_keep_mask`` on HF's q and k of the same
prefill; the global mask's count also checked through the method counters), the sinks and the
last prompt token always; there a continuation keeps the chain's earlier rows as they were and
selects in its new context alone, by the same global count."""

from __future__ import annotations

import json

import pytest
import requests
import torch

from conftest import expand_ranges, hf_argmax, start_server, stream_and_get

POOL = 1536
BASE = ["--dtype", "float32", "--max-total-tokens", str(POOL), "--chunked-prefill-size", "128",
        "--log-level", "warning", "--sparse-method", "kvzip"]
PROMPTS = ["The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is",
           "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\ndef mul(a, b):\n"]
NEW = 8


@pytest.fixture(scope="module")
def full(request, default_model_dir):
    return start_server(BASE + ["--sparse-keep-ratio", "1.0"], request)


@pytest.fixture(scope="module")
def hf(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    return tok, model


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def probe_len(tok, ids, start: int = 0) -> int:
    """The probe's length for a prompt ``ids`` (a chain continuation resuming ``start`` tokens:
    the probe of its new context)."""
    from sglang_sparse.methods.kvzip import KVzipConfig, KVzipRuntime

    texts = KVzipRuntime.probe_texts(lambda t: tok.encode(t, add_special_tokens=False))
    return len(KVzipRuntime.probe_ids(KVzipConfig(), ids[:-1], texts, start))


def drop_chains(server) -> None:
    """Delete the idle chains (every request parks its rows: Chain Cache is on)."""
    for rec in requests.get(server.base_url + "/chain", timeout=60).json()["chains"]:
        if rec["status"] == "idle":
            assert requests.delete(f"{server.base_url}/chain/{rec['chain_id']}", timeout=60).status_code == 200


def kvzip_reference(model, tok, ids, ratio):
    """The plain-torch reference on HF's tensors of the same request: post-RoPE q and k of
    ``prompt[:-1] + probe`` (what the server prefills), ``kvzip_probe_scores`` per layer,
    ``kvzip_keep_mask`` over all layers and heads, each layer widened as the store keeps it.
    Returns (per layer ``[Hkv, B_l]`` kept context positions, the global mask's count)."""
    from sgl_kernel_sparse.reference import kvzip_keep_mask, kvzip_probe_scores
    from transformers.models.llama import modeling_llama

    from sglang_sparse.methods.kvzip import KVzipConfig, KVzipRuntime, widen_to_layer

    ctx = ids[:-1]
    probe = KVzipRuntime.probe_ids(KVzipConfig(), ctx, KVzipRuntime.probe_texts(
        lambda t: tok.encode(t, add_special_tokens=False)))
    seen, rope = [], modeling_llama.apply_rotary_pos_emb

    def record(q, k, *args, **kwargs):
        q2, k2 = rope(q, k, *args, **kwargs)
        seen.append((q2[0].transpose(0, 1), k2[0].transpose(0, 1)))  # [T, H, D] per layer
        return q2, k2

    modeling_llama.apply_rotary_pos_emb = record
    try:
        with torch.no_grad():
            model(torch.tensor([ctx + probe]))
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
    c = len(ctx)
    pos = torch.arange(c, c + len(probe))
    scores = torch.stack([kvzip_probe_scores(q[c:].float(), k.float(), pos, c) for q, k in seen])
    mask = kvzip_keep_mask(scores, ratio)
    return [widen_to_layer(mask[layer], scores[layer]) for layer in range(scores.shape[0])], int(mask.sum())


def stats(server) -> dict:
    return requests.get(server.base_url + "/sparse/stats", timeout=60).json()


def gen(server, ids, n=NEW, **extra):
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra}
    return requests.post(server.base_url + "/generate", json=body, timeout=300)


def test_keep_all_equals_dense_and_releases_exactly_the_probe(full, hf):
    tok, model = hf
    drop_chains(full)  # the server's warm-up request parked a chain
    before = stats(full)
    for text in PROMPTS:
        ids = tok.encode(text)
        s0 = stats(full)
        resp = gen(full, ids)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        assert out["output_ids"] == hf_greedy(model, ids, NEW), text
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == NEW
        assert out["text"] == tok.decode(out["output_ids"])
        s1 = stats(full)
        c0, c1 = s0["counters"], s1["counters"]
        assert c1["kvzip_probes"] == c0["kvzip_probes"] + 1, c1
        assert c1["kvzip_padded_entries"] == c0["kvzip_padded_entries"]
        assert c1["compactions"] == c0["compactions"] + 1 and c1["evictions"] == c0["evictions"] + 1
        # keep ratio 1: only the probe's rows go (S tokens after the N - 1 context tokens), in
        # every layer (rows_released counts layer rows)
        assert c1["slots_released"] - c0["slots_released"] == probe_len(tok, ids), (c0, c1)
        layers = model.config.num_hidden_layers
        assert c1["rows_released"] - c0["rows_released"] == probe_len(tok, ids) * layers, (c0, c1)
    drop_chains(full)
    after = stats(full)
    assert after["running_requests"] == 0 and after["integrity"]["ok"], after["integrity"]
    assert after["kv_free_slots"] == before["kv_free_slots"] == after["kv_total_slots"]


def test_stream_retention_and_openai(full, hf):
    tok, _ = hf
    ids = tok.encode(PROMPTS[0])
    body = {"input_ids": ids, "rid": "kvzip-stream", "sampling_params": {"temperature": 0, "max_new_tokens": 12,
                                                                        "ignore_eos": True}}
    mid, first, last = stream_and_get(full, body, "/sparse/requests/kvzip-stream/retention")
    assert mid.status_code == 200, mid.text
    ret = mid.json()
    n = ret["logical_len"]
    assert len(ids) <= n < len(ids) + 12  # the probe's logical positions are gone
    assert ret["kept_fraction"] == 1.0
    for layer in ret["layers"]:
        for head in layer["heads"]:
            assert expand_ranges(head["ranges"]) == list(range(n))
    plain = gen(full, ids, 12).json()
    assert last["text"] == plain["text"] and last["output_ids"] == plain["output_ids"]
    assert last["meta_info"]["prompt_tokens"] == len(ids)
    resp = requests.post(full.base_url + "/v1/completions", timeout=300, json={
        "model": "default", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens"] == len(tok.encode(PROMPTS[0])) and usage["completion_tokens"] <= 4
    drop_chains(full)
    assert stats(full)["kv_free_slots"] == stats(full)["kv_total_slots"]


def test_refusals_are_sentences(full):
    too_long = gen(full, [1000 + i for i in range(POOL * 2 // 3)], 4)  # fits the pool, + probe does not
    assert too_long.status_code == 400
    assert "input_ids gives a prompt of" in too_long.text and "reconstruction probe" in too_long.text, too_long.text
    parallel = requests.post(full.base_url + "/generate", timeout=300, json={
        "input_ids": [1000, 1001, 1002], "sampling_params": {"max_new_tokens": 2, "n": 2}})
    assert parallel.status_code == 400 and "parallel samples" in parallel.text, parallel.text
    # max_new_tokens 0 is SGLang's prefill-only path, which never samples the token the probe
    # replaces: the request used to hang, unanswered
    none = gen(full, [1000, 1001, 1002], 0)
    assert none.status_code == 400 and "max_new_tokens must be >= 1 (it was 0)" in none.text, none.text
    false = gen(full, [1000, 1001, 1002], False)  # equals 0 in Python, but refused by its type first
    assert false.status_code == 400 and "max_new_tokens: invalid type: boolean" in false.text, false.text
    one = gen(full, [1000], 2)  # no context to score: served without a probe
    assert one.status_code == 200 and one.json()["meta_info"]["prompt_tokens"] == 1, one.text
    session = gen(full, [1000, 1001, 1002], 2, session_params={"id": "s1"})
    assert session.status_code == 400 and "session_params" in session.text and "chain_id" in session.text, session.text
    # a continuation whose new context + probe do not fit: 400 from the scheduler, the chain stays
    head = [1000 + i for i in range(40)]
    out = gen(full, head, 2).json()
    first = out["meta_info"]
    long = gen(full, head + out["output_ids"] + [2000 + i for i in range(POOL * 2 // 3)], 2,
               chain_id=first["chain_id"])
    assert long.status_code == 400 and "input_ids gives a prompt of" in long.text, long.text
    assert "reconstruction probe" in long.text, long.text
    rec = requests.get(f"{full.base_url}/chain/{first['chain_id']}", timeout=60).json()
    assert rec["status"] == "idle", rec
    drop_chains(full)
    assert stats(full)["kv_free_slots"] == stats(full)["kv_total_slots"]


def test_chain_continuations_equal_hf_on_the_whole_conversation(full, hf):
    """Keep ratio 1: each turn resumes the chain's rows, prefills only its new tokens + the probe
    of its new context (exactly the probe's rows released after), and greedy output equals HF on
    the whole conversation; a turn whose only new token is its last runs no probe."""
    tok, model = hf
    ids = tok.encode(PROMPTS[0])
    out = gen(full, ids).json()
    cid, layers = out["meta_info"]["chain_id"], model.config.num_hidden_layers
    assert out["meta_info"]["chain_status"] == "created"
    turns = [tok.encode(" The capital of Germany is", add_special_tokens=False),
             tok.encode("\nQ: and of Portugal?\nA:", add_special_tokens=False), []]
    for n, extra in enumerate(turns):
        done = ids + out["output_ids"]
        rec = requests.get(f"{full.base_url}/chain/{cid}", timeout=60).json()
        assert rec["status"] == "idle" and rec["processed_tokens"] == len(done) - 1, rec  # the last: no KV yet
        start = rec["processed_tokens"]
        ids = done + extra
        c0 = stats(full)["counters"]
        resp = gen(full, ids, chain_id=cid)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        meta = out["meta_info"]
        assert (meta["chain_id"], meta["chain_status"], meta["reused_tokens"]) == (cid, "resumed", start)
        assert meta["cached_tokens"] == start and meta["prompt_tokens"] == len(ids), meta
        assert out["output_ids"] == hf_argmax(model, ids, NEW), n
        c1 = stats(full)["counters"]
        probe = probe_len(tok, ids, start) if len(ids) - 1 > start else 0
        assert c1["kvzip_probes"] - c0["kvzip_probes"] == (1 if probe else 0), (n, c0, c1)
        assert c1["slots_released"] - c0["slots_released"] == probe, (n, c0, c1)
        assert c1["rows_released"] - c0["rows_released"] == probe * layers, (n, c0, c1)
    assert probe == 0  # the last turn sends the conversation as it is: only its last token is new
    s = stats(full)
    assert s["running_requests"] == 0 and s["integrity"]["ok"], s["integrity"]
    assert s["kv_free_slots"] + s["chain_idle_rows"] == s["kv_total_slots"]
    drop_chains(full)
    assert stats(full)["kv_free_slots"] == stats(full)["kv_total_slots"]


def test_bad_flags_are_launcher_sentences():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    with pytest.raises(ConfigError, match="keep_ratio=0.0 is out of range"):
        sparse_config(["--device", "cpu", "--sparse-method", "kvzip", "--sparse-keep-ratio", "0"], log=lambda m: None)
    config, _ = sparse_config(["--device", "cpu", "--sparse-method", "kvzip", "--sparse-keep-ratio", "0.4"],
                              log=lambda m: None)
    assert config["method"] == "kvzip" and config["chain_cache"] is True
    config, _ = sparse_config(["--device", "cpu", "--sparse-method", "kvzip", "--chain-cache", "off"],
                              log=lambda m: None)
    assert config["chain_cache"] is False


RATIO = 0.3


@pytest.fixture(scope="module")
def third(request, full, default_model_dir):
    full.stop()  # one server at a time on a small machine
    return start_server(BASE + ["--sparse-keep-ratio", str(RATIO)], request)


def test_global_threshold_counts_sinks_and_last_token_kept(third, hf):
    tok, model = hf
    ids = tok.encode(PROMPTS[1] * 2)
    c0 = stats(third)["counters"]
    body = {"input_ids": ids, "rid": "kvzip-ratio", "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                       "ignore_eos": True}}
    mid, _, last = stream_and_get(third, body, "/sparse/requests/kvzip-ratio/retention")
    assert mid.status_code == 200, mid.text
    assert last["meta_info"]["prompt_tokens"] == len(ids) and len(last["output_ids"]) == 8
    ret, c1 = mid.json(), stats(third)["counters"]
    ctx, n, layers, heads = len(ids) - 1, ret["logical_len"], ret["num_layers"], ret["kv_heads"]
    assert c1["kvzip_probes"] == c0["kvzip_probes"] + 1
    ref_keep, ref_selected = kvzip_reference(model, tok, ids, RATIO)
    widened = 0
    for layer in ret["layers"]:
        per_head = [expand_ranges(h["ranges"]) for h in layer["heads"]]
        want = ref_keep[layer["layer"]].tolist()  # the reference's kept context positions per head
        assert [[p for p in kept if p < ctx] for kept in per_head] == want, layer["layer"]
        context_kept = {len([p for p in kept if p < ctx]) for kept in per_head}
        assert len(context_kept) == 1  # B_l rows per head in a layer
        widened += context_kept.pop() * heads
        for kept in per_head:
            assert kept[:4] == [0, 1, 2, 3]  # sinks
            assert [p for p in kept if p >= ctx] == list(range(ctx, n))  # last prompt token + decoded
    # the global selection keeps floor(ratio * layers * heads * context) entries; the store widens
    # each layer to its widest head (counted in kvzip_padded_entries)
    selected = widened - (c1["kvzip_padded_entries"] - c0["kvzip_padded_entries"])
    assert selected == int(RATIO * layers * heads * ctx) == ref_selected
    assert widened < 0.8 * layers * heads * ctx
    # each layer released its rows past its B_l kept context rows (the probe's included)
    held = ctx + probe_len(tok, ids)
    assert c1["evictions"] == c0["evictions"] + 1
    assert c1["rows_released"] - c0["rows_released"] == layers * held - widened // heads, (c0, c1)
    drop_chains(third)
    s = stats(third)
    assert s["running_requests"] == 0 and s["integrity"]["ok"] and s["kv_free_slots"] == s["kv_total_slots"]


def test_a_continuation_keeps_earlier_rows_and_selects_in_its_new_context(third, hf):
    """Ratio 0.3: turn 2's retention keeps turn 1's positions exactly; in the new context
    ``[M, P)`` each layer keeps one count per head, and the counts add up to the global
    selection over ``layers * heads * (P - M)`` entries (plus the layer widening)."""
    tok, _ = hf
    ids = tok.encode(PROMPTS[1] * 2)
    out = gen(third, ids).json()
    cid = out["meta_info"]["chain_id"]
    before = requests.get(f"{third.base_url}/chain/{cid}/retention", timeout=60).json()
    start = before["logical_len"]
    ids = ids + out["output_ids"] + tok.encode(PROMPTS[0], add_special_tokens=False)
    c0 = stats(third)["counters"]
    resp = gen(third, ids, chain_id=cid)
    assert resp.status_code == 200, resp.text
    meta = resp.json()["meta_info"]
    assert (meta["chain_status"], meta["reused_tokens"], meta["prompt_tokens"]) == ("resumed", start, len(ids))
    c1 = stats(third)["counters"]
    assert c1["kvzip_probes"] == c0["kvzip_probes"] + 1
    after = requests.get(f"{third.base_url}/chain/{cid}/retention", timeout=60).json()
    ctx, heads, layers = len(ids) - 1, after["kv_heads"], after["num_layers"]
    widened = 0
    for old, new in zip(before["layers"], after["layers"]):
        counts = set()
        for h_old, h_new in zip(old["heads"], new["heads"]):
            kept_old, kept = expand_ranges(h_old["ranges"]), expand_ranges(h_new["ranges"])
            assert [p for p in kept if p < start] == kept_old  # earlier turns' rows stay
            fresh = [p for p in kept if start <= p < ctx]
            counts.add(len(fresh))
            assert [p for p in kept if p >= ctx] == list(range(ctx, after["logical_len"]))
        assert len(counts) == 1
        widened += counts.pop() * heads
    selected = widened - (c1["kvzip_padded_entries"] - c0["kvzip_padded_entries"])
    assert selected == int(RATIO * layers * heads * (ctx - start))
    assert widened < 0.8 * layers * heads * (ctx - start)
    drop_chains(third)
    s = stats(third)
    assert s["running_requests"] == 0 and s["integrity"]["ok"] and s["kv_free_slots"] == s["kv_total_slots"]
