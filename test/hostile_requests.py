"""Hypothesis strategies for hostile requests: every field sglang_sparse's routes read or change,
with values of the wrong type, out of range, empty, huge or malformed.

A drawn request is ``(method, path, json_body)``: a valid body for the route, then none, one or
a few of its fields replaced by a hostile value (or a body that is no JSON object at all), so
that both the checks and the paths behind them run. Bodies stay small (a few dozen tokens) and
generation asks for at most a few tokens, so hundreds of requests run on a 2-core CPU.
"""

from __future__ import annotations

from hypothesis import strategies as st

VOCAB = 49152  # the default model (SmolLM2-135M-Instruct)

# JSON values of every type, small.
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=8)
numbers = st.one_of(st.integers(-5, 10), st.floats(-2, 3, allow_nan=False), st.text(max_size=4), st.booleans(),
                    st.none(), st.just(10**30), st.just("0.5"))

# Hostile values for a length field (max_new_tokens, max_tokens): never a large valid one, so a
# request cannot run for thousands of tokens on a CPU.
lengths = st.one_of(st.integers(-3, 4), st.floats(-1, 3, allow_nan=False), st.text(max_size=4), st.booleans(),
                    st.just("2"), st.just([1]))

good_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)
bad_ids = st.one_of(
    st.lists(st.integers(-(2**40), 2**40), max_size=8),  # out of vocabulary, negative, huge
    st.just([]),
    st.lists(st.one_of(st.integers(0, 100), st.text(max_size=3), st.booleans(), st.none(), st.floats(0, 10)),
             min_size=1, max_size=5),
    st.lists(good_ids, min_size=1, max_size=2),  # nested (a batch)
    junk,
)
good_text = st.sampled_from(["Hello, my name is", "The capital of France is", "1 2 3 4", "Tell me a story."])
bad_text = st.one_of(st.just(""), st.just(" "), st.text(max_size=40), junk)
chain_ids = st.one_of(st.just("chain-1"), st.just("session-x"), st.text(max_size=10), st.integers(), st.booleans(),
                      st.lists(st.text(max_size=3), max_size=2), st.just("x" * 300), junk)
keys = st.one_of(st.none(), st.text(max_size=8), st.integers(), st.booleans(), st.lists(scalars, max_size=2),
                 st.dictionaries(st.text(max_size=3), scalars, max_size=2))
good_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                                "content": good_text}), min_size=1, max_size=3)
bad_messages = st.one_of(
    st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]), junk, max_size=3),
             max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                    "content": st.lists(st.one_of(junk, st.just({"type": "text", "text": "hi"})),
                                                        max_size=2)}), min_size=1, max_size=2),
    st.lists(junk, max_size=3),
    junk,
)


KEEP = ("max_new_tokens", "max_tokens")  # never dropped: their defaults generate for a long time


@st.composite
def hostile(draw, valid: dict, fields: dict) -> dict:
    """``valid`` with up to three of ``fields`` (name -> hostile strategy) replaced or added."""
    body = dict(valid)
    names = sorted(fields)
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0 and name not in KEEP:
            body.pop(name, None)
        else:
            body[name] = draw(fields[name])
    return body


@st.composite
def sampling_params(draw):
    valid = {"max_new_tokens": draw(st.integers(1, 3)), "temperature": 0}
    return draw(hostile(valid, {
        "max_new_tokens": lengths, "temperature": numbers, "top_p": numbers, "top_k": numbers,
        "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=2), junk),
        "ignore_eos": junk, "n": numbers,
        "custom_params": st.one_of(st.none(), st.fixed_dictionaries({"chain_id": chain_ids}), junk)}))


@st.composite
def generate(draw):
    valid = {"sampling_params": draw(sampling_params()),
             **(({"text": draw(good_text)}) if draw(st.booleans()) else {"input_ids": draw(good_ids)})}
    body = draw(hostile(valid, {
        "text": bad_text, "input_ids": bad_ids, "chain_id": chain_ids, "stream": st.one_of(st.booleans(), junk),
        "extra_key": keys, "rid": keys, "return_logprob": junk, "session_params": junk,
        "sampling_params": junk}))
    return "POST", "/generate", body


@st.composite
def openai(draw):
    chat = draw(st.booleans())
    valid = {"model": "default", "max_tokens": draw(st.integers(1, 3)), "temperature": 0}
    if chat:
        valid["messages"] = draw(good_messages)
    else:
        valid["prompt"] = draw(st.one_of(good_text, good_ids))
    body = draw(hostile(valid, {
        "messages" if chat else "prompt": bad_messages if chat else st.one_of(bad_text, bad_ids),
        "model": junk, "max_tokens": lengths, "chain_id": chain_ids, "stream": st.one_of(st.booleans(), junk),
        "n": st.one_of(st.integers(1, 2), numbers), "temperature": numbers,
        "stream_options": st.one_of(st.just({"include_usage": True}), junk)}))
    return "POST", "/v1/chat/completions" if chat else "/v1/completions", body


SEQUENCE_FIELDS = {"token_ids": bad_ids, "text": bad_text, "messages": bad_messages, "extra_key": keys,
                   "cache_salt": keys}


@st.composite
def sequence(draw) -> dict:
    which = draw(st.sampled_from(["token_ids", "text", "messages"]))
    value = {"token_ids": good_ids, "text": good_text, "messages": good_messages}[which]
    return {which: draw(value)}


ranges = st.one_of(
    st.lists(st.lists(st.integers(-4, 80), min_size=2, max_size=2), min_size=1, max_size=3),
    st.lists(junk, max_size=3), junk,
)


@st.composite
def prune(draw):
    valid = {**draw(sequence()), "ranges": [[0, 4]], "keep_ratio": 0.5, "wait": True}
    body = draw(hostile(valid, {**SEQUENCE_FIELDS, "ranges": ranges, "keep_ratio": numbers, "keep_tokens": numbers,
                                "policy": st.one_of(st.sampled_from(["kvzip", "snapkv"]), junk),
                                "wait": junk}))
    return "POST", "/prune", body


@st.composite
def prefix_admin(draw):
    path = draw(st.sampled_from(["/prefix/inspect", "/prefix/priority", "/prefix/delete"]))
    valid = {**draw(sequence()), **({"priority": 1} if path == "/prefix/priority" else {})}
    return "POST", path, draw(hostile(valid, {**SEQUENCE_FIELDS, "priority": numbers}))


@st.composite
def admin_reads(draw):
    ident = draw(st.one_of(st.text(min_size=1, max_size=12), st.just("chain-1"), st.just("prune-1")))
    ident = "".join(c for c in ident if c.isprintable() and c not in "/?#%\\") or "x"
    return draw(st.sampled_from([("GET", f"/chain/{ident}", None), ("DELETE", f"/chain/{ident}", None),
                                 ("GET", f"/prune/{ident}", None), ("GET", "/chain", None),
                                 ("GET", "/sparse/stats", None)]))


@st.composite
def not_an_object(draw):
    """A body that is not a JSON object at all."""
    path = draw(st.sampled_from(["/generate", "/prune", "/prefix/inspect", "/v1/completions"]))
    return "POST", path, draw(st.one_of(st.lists(scalars, max_size=3), scalars))


any_request = st.one_of(generate(), openai(), prune(), prefix_admin(), admin_reads(), not_an_object())
