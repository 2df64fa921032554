"""Generation requests checked before SGLang takes them (main process).

- **Prompts** (BEFORE ``TokenizerManager._validate_one_request``, after tokenization): at least
  one token, every id in ``[0, vocab)``. SGLang 0.5.23 lets both through to the scheduler, where
  an empty prompt fails a reshape and an out-of-vocabulary id the embedding lookup, and the
  server dies.
- **Chains** (AROUND ``serve_generate_request`` and ``OpenAIServingBase.handle_request``): a
  top-level ``chain_id`` (or ``sampling_params.custom_params.chain_id``) must be a string, names
  one chain (no batch, no ``n > 1``), and means the same for every method: on a server whose
  Chain Cache is off it is refused with a sentence saying how to turn it on. The top-level form
  is moved into ``custom_params`` (the one per-request field SGLang carries to the scheduler).
- **Streams** (same hooks): a streamed request refused before it generates anything (a chain
  error from the scheduler, a prompt check, SGLang's own length checks) gets the status code and
  message a non-streamed one gets, instead of HTTP 200 and an error inside the stream. The
  response's first chunk is awaited before the headers go out (``_prime``); once a chunk has
  been produced the stream proceeds as SGLang's.

Errors use SGLang's bodies, as a non-streamed request gets them: on ``/generate`` a 400 is
``{"error": {"message": ...}}`` (its ``_create_error_response``) and other statuses are
``ErrorResponse``; the OpenAI routes answer ``ErrorResponse``.
"""

from __future__ import annotations

import functools
import types
from dataclasses import dataclass

from sglang_sparse.core.chain_index import CHAIN_KEY, dp_rank_of, key_of_chain, session_chain_id
from sglang_sparse.validation import RequestError, check_token_ids, expect_chain_id, expect_int, is_int, show
from sglang_sparse.srt import activation
from sglang_sparse.srt.api import probe
from sglang_sparse.srt.admin.http import generate_error_response
from sglang_sparse.srt.state import STATE

# -- prompts ---------------------------------------------------------------------------------------
def before_validate_one_request(manager, obj, input_ids, *args, **kwargs):
    from sglang.srt.managers.io_struct import GenerateReqInput

    if not isinstance(obj, GenerateReqInput) or obj.input_embeds is not None or obj.contains_mm_input():
        return None
    field = "input_ids" if obj.input_ids is not None else "text"
    if not isinstance(input_ids, list):
        raise RequestError(field, f"{field} must be a list of token ids, got {show(input_ids)}")
    if not input_ids:
        raise RequestError(field, f"{field} gives an empty prompt (0 tokens after tokenization); "
                                  "send at least one token")
    check_token_ids(field, input_ids, manager.model_config.vocab_size)
    probe.rewrite_prompt(manager, obj, input_ids, field)  # methods that need the engine probe
    return None


def around_contract_error(original, body, *args, **kwargs):
    """SGLang's ``/generate`` schema check says what is wrong (``invalid type: boolean `true`,
    expected i64``) but not where: find the one field whose removal makes the body pass and name
    it (one level into ``sampling_params``)."""
    message = original(body, *args, **kwargs)
    if message is None or not isinstance(body, dict):
        return message
    field = _culprit(original, body)
    return f"{field}: {message}" if field else message


def _culprit(check, body: dict, prefix: str = "") -> str | None:
    for key, value in body.items():
        if check({k: v for k, v in body.items() if k != key}) is None:
            if isinstance(value, dict) and value:
                inner = _culprit(lambda sub: check({**body, key: sub}), value, f"{prefix}{key}.")
                if inner:
                    return inner
            return f"{prefix}{key}"
    return None


MAX_N = 128  # parallel samples per prompt (OpenAI's own limit)
# fields of a /generate batch that SGLang 0.5.23 takes as one value or a list it indexes per prompt
# without checking its length (an IndexError, a 500, otherwise; an empty modalities list is not indexed)
PER_PROMPT_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_sampling_mask",
                     "sampling_logprobs_mode", "custom_logit_processor", "lora_path", "lora_id", "modalities",
                     "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size")
SESSION_FIELDS = types.MappingProxyType(
    {"id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool})


def check_generate_fields(obj, prompts: int) -> None:
    """The fields of a ``/generate`` body that SGLang 0.5.23 uses before checking them (a 500,
    or worse, otherwise): ``sampling_params`` as a list (indexed), its ``custom_params``
    (unpacked), ``session_params`` (unpacked into SGLang's SessionParams)."""
    if prompts == 0:  # SGLang answers an empty batch with [] but indexes a list of sampling_params
        raise RequestError("text", "text is an empty list: a batch needs at least one prompt")
    sps = obj.sampling_params
    if isinstance(sps, list) and len(sps) != prompts:
        raise RequestError("sampling_params", f"sampling_params must be an object, or a list of {prompts} "
                                              f"object(s), one per prompt; got a list of {len(sps)}")
    # one prompt that is not a batch keeps a list of sampling_params only when n > 1 turns it into
    # one (SGLang then expands the list); otherwise SGLang calls .get on the list (a 500)
    if isinstance(sps, list) and not _is_batch(obj) and _parallel(sps) <= 1:
        raise RequestError("sampling_params", "sampling_params must be an object for a single prompt (text "
                                              "or input_ids not given as a list of prompts); a list of one "
                                              "object per prompt is for a batch")
    if _is_batch(obj):
        for name in PER_PROMPT_FIELDS:
            value = getattr(obj, name, None)
            if isinstance(value, list) and len(value) != prompts and (value or name != "modalities"):
                raise RequestError(name, f"{name} must be one value, or a list of {prompts} values, one per "
                                         f"prompt; got a list of {len(value)}")
    for sp in _as_list(sps):
        if isinstance(sp, dict) and "n" in sp:
            expect_int("sampling_params.n", sp["n"], 1, MAX_N)
        custom = sp.get("custom_params") if isinstance(sp, dict) else None
        if custom is not None and not isinstance(custom, dict):
            raise RequestError("sampling_params.custom_params", "sampling_params.custom_params must be an object "
                                                                f"or null, got {show(custom)}")
    rid = obj.rid
    if rid is not None and not isinstance(rid, str):
        if prompts == 1 or not (isinstance(rid, list) and len(rid) == prompts and all(isinstance(r, str) for r in rid)):
            raise RequestError("rid", f"rid must be a string{f' or a list of {prompts} strings' if prompts > 1 else ''}"
                                      f" or null, got {show(rid)}")
    sessions = obj.session_params
    for sess in (sessions if isinstance(sessions, list) else [sessions]):
        if sess is None:
            continue
        if not isinstance(sess, dict):
            raise RequestError("session_params", f"session_params must be an object, got {show(sess)}")
        for key, value in sess.items():
            want = SESSION_FIELDS.get(key)
            if want is None:
                raise RequestError(f"session_params.{key}", f"session_params has no field {show(key)}; its fields: "
                                                            f"{', '.join(SESSION_FIELDS)}")
            ok = value is None or (isinstance(value, want) and (want is bool or not isinstance(value, bool)))
            if not ok:
                words = {str: "a string", int: "an integer", bool: "true or false"}[want]
                raise RequestError(f"session_params.{key}", f"session_params.{key} must be {words} or null, "
                                                            f"got {show(value)}")


# -- chains ----------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def chains_on() -> bool:
    return bool(activation.load_config().get("chain_cache"))


def _chains_off_message(field: str) -> str:
    config = activation.load_config()
    from sglang_sparse.methods import get_method

    method = config.get("method", "dense")
    if not get_method(method).runtime_cls.supports_chains:
        return (f"{field}: --sparse-method {method} does not support Chain Cache (a continuation would need its "
                "own scoring over the resumed rows); leave chain_id out and send the whole conversation")
    return (f"{field}: Chain Cache is off on this server (--sparse-method {config.get('method', 'dense')} with "
            "--chain-cache off, or auto, which turns it on only for methods that evict KV); start the server "
            "with --chain-cache on to continue chains, or leave chain_id out")


def _custom_chain_ids(sampling_params) -> list:
    """The ``custom_params.chain_id`` values of one or more sampling-param dicts."""
    out = []
    for sp in _as_list(sampling_params):
        params = sp.get("custom_params") if isinstance(sp, dict) else None
        if isinstance(params, dict) and "chain_id" in params:
            out.append(params["chain_id"])
    return out


def check_chain_fields(top, custom: list, choices: int, prompts: int) -> str | None:
    """The chain a request names (None: it starts one if chains are on). Raises RequestError."""
    named = ([("chain_id", top)] if top is not None else []) + [
        ("sampling_params.custom_params.chain_id", c) for c in custom]
    if not named:
        return None
    field = named[0][0]
    if not chains_on():
        raise RequestError(field, _chains_off_message(field))
    for f, value in named:
        expect_chain_id(f, value)
    if len({v for _, v in named}) > 1:
        raise RequestError(field, f"chain_id and sampling_params.custom_params.chain_id name different chains "
                                  f"({', '.join(show(v) for _, v in named)})")
    if prompts > 1:
        raise RequestError(field, f"{field} names one chain; a batch of {prompts} prompts cannot continue it "
                                  "(send them as separate requests)")
    if choices > 1:
        raise RequestError(field, f"{field} cannot be combined with n={choices}: every choice would continue "
                                  "the same chain (ask for n=1)")
    return named[0][1]


def _with_chain_id(sampling_params, chain_id: str):
    """``sampling_params`` (None, a dict, or one per prompt) with ``custom_params.chain_id`` set."""
    return _with_custom(sampling_params, "chain_id", chain_id)


def _with_custom(sampling_params, key: str, value):
    if isinstance(sampling_params, list):
        return [_with_custom(sp, key, value) for sp in sampling_params]
    sp = dict(sampling_params or {})
    sp["custom_params"] = {**(sp.get("custom_params") or {}), key: value}
    return sp


# -- chains named by the router's routing key ---------------------------------------------------------
# sglang-router forwards only the request fields it knows (``custom_params`` and ``chain_id`` are
# dropped) but passes its routing-key header on. With Chain Cache on, a request carrying the header
# and no chain_id continues the chain named by the key (``key-<K>``, chains/scheduler.py): resumed
# when the request extends it, started over when it does not, so one agent session = one key.
ROUTING_HEADER = "x-smg-routing-key"  # copied into custom_params[CHAIN_KEY] (read by the scheduler)
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F))


def routing_key(request) -> str | None:
    """The routing key of a request (None without the header or with Chain Cache off)."""
    headers = getattr(request, "headers", None)
    value = headers.get(ROUTING_HEADER) if headers is not None else None
    if value is None or not chains_on():
        return None
    if not value or len(value) > 128 or not set(value) <= _KEY_CHARS:
        raise RequestError("X-SMG-Routing-Key", f"X-SMG-Routing-Key names this request's chain (Chain Cache is on): "
                                                f"use 1 to 128 printable ASCII characters without spaces, got {show(value)}")
    return value


def _chain_key(obj) -> str | None:
    params = obj.sampling_params.get("custom_params") if isinstance(obj.sampling_params, dict) else None
    key = params.get(CHAIN_KEY) if isinstance(params, dict) else None
    return key if isinstance(key, str) else None


async def _json_body(request) -> dict:
    try:
        body = await request.json()  # Starlette caches the parsed body
    except Exception:
        return {}
    return body if isinstance(body, dict) else {}


def _as_list(sampling_params) -> list:
    return sampling_params if isinstance(sampling_params, list) else [sampling_params]


def _prompt_count(obj) -> int:
    """Prompts in a ``/generate`` body (``_is_batch``: a list of texts or of token-id lists)."""
    if not _is_batch(obj):
        return 1
    return len(obj.text) if isinstance(obj.text, list) else len(obj.input_ids)


def _scheduler_rid(obj) -> str:
    """The rid the scheduler gives a chain request's one prompt. A batch of one (``["text"]``, an
    OpenAI ``prompt`` list) is normalized by SGLang into a list of rids: a given list is kept, a
    string ``R`` becomes ``[R + "_0"]`` (``GenerateReqInput._normalize_rid``)."""
    if isinstance(obj.rid, list):
        return str(obj.rid[0]) if obj.rid else ""
    return f"{obj.rid}_0" if _is_batch(obj) else obj.rid


def _is_batch(obj) -> bool:
    """A list of texts or of token-id lists: SGLang serves it as a batch (even of one)."""
    return isinstance(obj.text, list) or (isinstance(obj.input_ids, list) and bool(obj.input_ids)
                                          and isinstance(obj.input_ids[0], list))


def _openai_prompts(request) -> int:
    """Prompts in an OpenAI request: a completions ``prompt`` that is a list of texts or of
    token-id lists is a batch; a chat request is one conversation."""
    prompt = getattr(request, "prompt", None)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return len(prompt)
    return 1


def _parallel(sampling_params) -> int:
    """The largest ``n`` (parallel samples) asked for."""
    ns = [sp.get("n", 1) if isinstance(sp, dict) else 1 for sp in _as_list(sampling_params)]
    return max([n for n in ns if is_int(n)] or [1])


# -- streams ---------------------------------------------------------------------------------------
@dataclass
class Refusal:
    """Set by ``watch_first_output`` when a request's first output says it was refused."""

    status: int = 0
    message: str = ""


def watch_first_output(outputs):
    """Wrap ``TokenizerManager.generate_request``'s generator: a refusal before any output (an
    abort with an HTTP status, or a ValueError raised while the request is checked) is noted for
    ``_prime``, which runs this generator's first step in its own context."""
    holder = STATE.http.refusal.get()
    if holder is None:
        return outputs

    async def watched():
        first = True
        try:
            async for out in outputs:
                if first:
                    first = False
                    reason = _finish_reason(out)
                    status = reason.get("status_code") if isinstance(reason, dict) else None
                    if isinstance(reason, dict) and reason.get("type") == "abort" and is_int(status) and status >= 400:
                        holder.status, holder.message = int(status), str(reason.get("message") or "aborted")
                yield out
        except ValueError as err:
            if first:
                holder.status, holder.message = int(getattr(err, "status_code", 400)), str(err)
            raise

    return watched()


def _finish_reason(out):
    item = out[0] if isinstance(out, list) and out else out
    meta = item.get("meta_info") if isinstance(item, dict) else None
    return meta.get("finish_reason") if isinstance(meta, dict) else None


async def _prime(response, refused_response):
    """For a streaming response: produce its first chunk before anything is sent. A refusal
    becomes ``refused_response(status, message)``; otherwise the stream goes on unchanged."""
    from starlette.responses import Response, StreamingResponse

    if not isinstance(response, StreamingResponse):
        return response
    holder = STATE.http.refusal.get()
    body = response.body_iterator
    try:
        first = await body.__anext__()
    except StopAsyncIteration:  # the client went away before anything was generated
        return Response(status_code=204)
    if holder is not None and holder.status:
        await body.aclose()
        return refused_response(holder.status, holder.message)

    async def rest():
        yield first
        async for chunk in body:
            yield chunk

    response.body_iterator = rest()
    return response


async def around_serve_generate(original, obj, request, *args, **kwargs):
    body = await _json_body(request)
    try:
        check_generate_fields(obj, _prompt_count(obj))
        chain_id = check_chain_fields(body.get("chain_id"), _custom_chain_ids(obj.sampling_params),
                                      _parallel(obj.sampling_params), _prompt_count(obj))
    except RequestError as err:
        return generate_error_response(err.status, err.message, err.field)
    if body.get("chain_id") is not None:
        obj.sampling_params = _with_chain_id(obj.sampling_params, chain_id)
    try:
        key = routing_key(request)
    except RequestError as err:
        return generate_error_response(err.status, err.message, err.field)
    if key is not None and chain_id is None and _prompt_count(obj) == 1 and _parallel(obj.sampling_params) == 1 \
            and obj.session_params is None:
        obj.sampling_params = _with_custom(obj.sampling_params, CHAIN_KEY, key)
    token = STATE.http.refusal.set(Refusal()) if obj.stream else None
    try:
        response = await original(obj, request, *args, **kwargs)
        return await _prime(response, generate_error_response) if obj.stream else response
    finally:
        if token is not None:
            STATE.http.refusal.reset(token)


async def around_openai_request(original, serving, request, raw_request, *args, **kwargs):
    """OpenAI chat/completions: ``chain_id`` in the body (e.g. ``extra_body``), checked like
    ``/generate``'s; streamed refusals answered like non-streamed ones."""
    body = await _json_body(raw_request)
    custom = request.custom_params if isinstance(getattr(request, "custom_params", None), dict) else {}
    n = getattr(request, "n", 1)
    try:
        if n is not None:
            expect_int("n", n, 1, MAX_N)
        chain_id = check_chain_fields(body.get("chain_id"), [custom["chain_id"]] if "chain_id" in custom else [],
                                      n if is_int(n) else 1, _openai_prompts(request))
    except RequestError as err:
        return serving.create_error_response(err.message, param=err.field, status_code=err.status)
    if chain_id is not None:
        request.custom_params = {**custom, "chain_id": chain_id}
    try:
        key = routing_key(raw_request)
    except RequestError as err:
        return serving.create_error_response(err.message, param=err.field, status_code=err.status)
    if key is not None and chain_id is None and (n if is_int(n) else 1) == 1 and _openai_prompts(request) == 1:
        request.custom_params = {**(request.custom_params or {}), CHAIN_KEY: key}
    stream = bool(getattr(request, "stream", False))
    token = STATE.http.refusal.set(Refusal()) if stream else None
    try:
        response = await original(serving, request, raw_request, *args, **kwargs)
        if not stream:
            return response
        return await _prime(response, lambda status, message: serving.create_error_response(
            message, err_type="BadRequest" if status == 400 else str(status), status_code=status))
    finally:
        if token is not None:
            STATE.http.refusal.reset(token)


# -- a retry after a cancel -------------------------------------------------------------------------
# Requests running on a named chain (STATE.http.inflight: chain id -> (rid, HTTP request)). SGLang
# notices a client that went away only at the request's next output or after a few seconds of
# waiting; a retry on the same chain in that window would meet the chain still busy (409)
# although it is already lost.

def _forget(chain_id: str, rid: str) -> None:
    if STATE.http.inflight.get(chain_id, (None,))[0] == rid:
        del STATE.http.inflight[chain_id]


def _named_chain(obj):
    params = obj.sampling_params.get("custom_params") if isinstance(obj.sampling_params, dict) else None
    chain_id = params.get("chain_id") if isinstance(params, dict) else None
    return chain_id if isinstance(chain_id, str) else None


def _route_to_chain_rank(manager, obj, chain_id: str) -> None:
    """Data parallel: a continuation goes to the rank whose scheduler holds its chain (the rank
    is in the id, ``chain-r<k>-<n>``) through SGLang's per-request ``routed_dp_rank``, unless the
    client routed it itself. An id naming a rank this server lacks is left alone: the scheduler
    that gets it answers 404 (unknown chain)."""
    key = key_of_chain(chain_id)
    if key is not None:  # a routing key's chain
        _route_keyed_chain(manager, obj, key)
        return
    rank, ranks = dp_rank_of(chain_id), _dp_ranks(manager)
    if rank is not None and ranks > 1 and rank < ranks and getattr(obj, "routed_dp_rank", None) is None:
        obj.routed_dp_rank = rank


def _dp_ranks(manager) -> int:
    return int(getattr(manager, "elastic_worker_count", 0) or getattr(manager.server_args, "dp_size", 1) or 1)


def _route_keyed_chain(manager, obj, key: str) -> None:
    """Data parallel: a routing key's chain lives on the rank its key hashes to (stable across
    restarts of the HTTP process), unless the client routed the request itself."""
    import zlib

    ranks = _dp_ranks(manager)
    if ranks > 1 and getattr(obj, "routed_dp_rank", None) is None:
        obj.routed_dp_rank = zlib.crc32(key.encode()) % ranks


def around_generate_request(original, manager, obj, request=None, *args, **kwargs):
    """Watch the first output (streamed refusals); a request naming a chain whose previous
    request's client has gone away aborts that request first. The abort reaches the scheduler
    before this request does (one ordered channel), and the scheduler invalidates the chain on
    it (``chains.after_abort_request``): the retry is answered 410 at once."""
    chain_id = _named_chain(obj) if chains_on() else None
    if chain_id is None:
        key = _chain_key(obj) if chains_on() else None
        if key is not None:
            _route_keyed_chain(manager, obj, key)
        session = obj.session_params if isinstance(obj.session_params, dict) else None
        if session is not None and isinstance(session.get("id"), str):
            # SGLang opens a session on every DP rank and balances its requests like any other,
            # so a turn could meet a rank that holds neither the previous turn nor its chain:
            # a session's requests go to the rank its id hashes to
            _route_keyed_chain(manager, obj, session_chain_id(session["id"]))
        return watch_first_output(probe.fix_prompt_tokens(original(manager, obj, request, *args, **kwargs), obj))
    if obj.rid is None:
        import uuid

        obj.rid = uuid.uuid4().hex  # a chain request is one prompt, one sample (check_chain_fields)
    rid = _scheduler_rid(obj)
    _route_to_chain_rank(manager, obj, chain_id)

    async def tracked():
        prev = STATE.http.inflight.get(chain_id)
        if prev is not None and prev[1] is not None and await prev[1].is_disconnected():
            manager.abort_request(prev[0])
        STATE.http.inflight[chain_id] = (rid, request)
        done = False
        try:
            async for out in probe.fix_prompt_tokens(original(manager, obj, request, *args, **kwargs), obj):
                if _finish_reason(out) is not None:
                    done = True
                    _forget(chain_id, rid)
                yield out
            done = True
        finally:
            _forget(chain_id, rid)
            if not done:  # closed before its last output: the client went away; abort it now
                manager.abort_request(rid)

    return watch_first_output(tracked())


def validation_handler(sglang_handler):
    """The handler of FastAPI's request-validation errors. SGLang's renders ``str(exc)``: the
    endpoint's file path and line. The same ``ErrorResponse`` is built from the error list
    alone (field path and pydantic's sentence); SGLang's own shapes for ``/v1/messages`` and
    ``/v1/systemone`` are left to its handler (``sglang_handler``)."""

    async def handler(request, exc):
        path = request.url.path
        if sglang_handler is not None and path.startswith(("/v1/messages", "/v1/systemone")):
            return await sglang_handler(request, exc)
        from fastapi.responses import JSONResponse

        errors = exc.errors()
        parts = []
        for err in errors[:5]:
            loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
            parts.append(f"{loc}: {err.get('msg', 'invalid')}")
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        first = ".".join(str(x) for x in errors[0].get("loc", ()) if x != "body") if errors else None
        return JSONResponse({"object": "error", "message": "; ".join(parts) + more, "type": "Bad Request",
                             "param": first or None, "code": 400}, status_code=400)

    return handler


def routing_error_handler(sglang_handler):
    """The handler of Starlette's ``HTTPException``. Its routing errors, 404 (no route) and 405 (a
    route without this method, e.g. ``GET /prune/.``, which the client normalizes to ``/prune/``
    and Starlette redirects to ``POST``-only ``/prune``), come as ``{"detail": "Not Found"}``: no
    sentence saying what is allowed. Those two get one (``message``, next to ``detail``); every
    other ``HTTPException`` goes to SGLang's handler (FastAPI's by default)."""

    async def handler(request, exc):
        code = exc.status_code
        if code in (404, 405) and exc.detail in ("Not Found", "Method Not Allowed"):
            from fastapi.responses import JSONResponse

            path = request.url.path
            if code == 405:
                allowed = (exc.headers or {}).get("Allow", "")
                text = f"{request.method} is not allowed on {path}" + (f"; allowed: {allowed}" if allowed else "")
            else:
                text = f"no route {request.method} {path}: see GET /openapi.json for the routes this server has"
            return JSONResponse({"detail": exc.detail, "object": "error", "message": text,
                                 "type": exc.detail, "param": "path", "code": code},
                                status_code=code, headers=exc.headers)
        if sglang_handler is not None:
            return await sglang_handler(request, exc)
        from fastapi.exception_handlers import http_exception_handler

        return await http_exception_handler(request, exc)

    return handler
