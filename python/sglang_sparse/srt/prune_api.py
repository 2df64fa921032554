"""HTTP side of prefix-cache pruning and prefix admin (main process; ``docs/pruning.md``).

- ``POST /prune``: ``token_ids`` | ``text`` | ``messages`` (rendered with the server's chat
  template), ``ranges`` ``[[L, R], ...]`` (zero-based, half-open, logical token positions),
  ``keep_ratio`` | ``keep_tokens``, ``policy`` (``kvzip`` default, or ``snapkv``), ``wait``.
  Bad input is answered at once with a 4xx and a sentence. Otherwise 202 and a record whose
  ``prune_id`` ``GET /prune/{id}`` reports (``queued|running|completed|blocked|failed``,
  ``original_tokens``, ``retained_tokens``); with ``"wait": true`` the finished record (200).
- ``POST /prefix/inspect`` (blocks of a cached prefix: logical and retained tokens, lock,
  priority, pruning records), ``POST /prefix/priority`` (eviction priority of a prefix path),
  ``POST /prefix/delete`` (drop an idle cached subtree).

Each step runs in the scheduler through the dumper-control round trip (``chains.around_dumper_control``);
the scoring probe is an ordinary generation request (``srt/prune.py``).
"""

from __future__ import annotations

import asyncio
import itertools

from fastapi import Request  # the handlers' annotation (FastAPI resolves it by name)

PRUNES: dict[str, dict] = {}
_tasks: set = set()
_local_ids = itertools.count(1)


def _http(status: int, message: str):
    from fastapi import HTTPException

    return HTTPException(status_code=status, detail=message)


async def _control(op: str, body: dict) -> dict:
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import DumperControlReqInput

    tm = get_global_state().tokenizer_manager
    outs = await tm.dumper_control(DumperControlReqInput(method=f"sglang_sparse/{op}", body=body))
    out = outs[0]
    if not out.success or not out.response:
        raise _http(500, f"{op} failed in the scheduler: {out.error}")
    result = out.response[0]
    if isinstance(result.get("status"), int) and result["status"] >= 400:
        raise _http(result["status"], result["message"])
    return result


async def _body(request) -> dict:
    try:
        body = await request.json()
    except Exception:
        raise _http(400, "the request body is not JSON") from None
    if not isinstance(body, dict):
        raise _http(400, "the request body must be a JSON object")
    return body


def _token_ids(body: dict) -> list[int]:
    """The cached sequence, from exactly one of token_ids, text, messages."""
    from sglang.srt.entrypoints.http_server import get_global_state

    given = [k for k in ("token_ids", "text", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise _http(400, "name the cached sequence with exactly one of token_ids, text or messages")
    if given[0] == "token_ids":
        ids = body["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise _http(400, "token_ids must be a list of integers")
        return ids
    tokenizer = get_global_state().tokenizer_manager.tokenizer
    if given[0] == "text":
        if not isinstance(body["text"], str):
            raise _http(400, "text must be a string")
        return list(tokenizer.encode(body["text"]))
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise _http(400, "messages must be a list of chat messages ({role, content})")
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False))


def _probe_ids(plan: dict, tokens: list[int], policy: str) -> list[int]:
    """The probe's prompt: snapkv re-reads the sequence (its tail is recomputed as the
    observation window); kvzip appends "repeat the context" + each interval's tokens."""
    if policy == "snapkv":
        return list(tokens)
    from sglang.srt.entrypoints.http_server import get_global_state

    from sglang_sparse.core.pruning import KVZIP_PROMPT

    prompt = list(get_global_state().tokenizer_manager.tokenizer.encode(KVZIP_PROMPT, add_special_tokens=False))
    ids = list(tokens) + prompt
    for left, right in plan["ranges"]:
        ids += tokens[left:right]
    return ids


async def _run(record: dict, tokens: list[int], policy: str) -> None:
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_sparse.srt.prune import PROBE_KEY

    pid = record["prune_id"]
    record["status"] = "running"
    try:
        probe = GenerateReqInput(
            input_ids=_probe_ids(record, tokens, policy), rid=f"{pid}-probe",
            sampling_params={"max_new_tokens": 1, "temperature": 0,
                             "custom_params": {PROBE_KEY: pid}})
        async for _ in get_global_state().tokenizer_manager.generate_request(probe, None):
            pass
        result = await _control("prune_apply", {"prune_id": pid})
        record.update(result)
    except Exception as err:  # noqa: BLE001 - reported in the record
        record.update(status="failed", reason=getattr(err, "detail", None) or repr(err))
        try:
            await _control("prune_forget", {"prune_id": pid})
        except Exception:  # noqa: BLE001
            pass


async def prune(request: Request):
    """POST /prune."""
    from fastapi.responses import JSONResponse

    body = await _body(request)
    tokens = _token_ids(body)
    policy = body.get("policy", "kvzip")
    plan_body = {k: body.get(k) for k in ("ranges", "keep_ratio", "keep_tokens", "extra_key", "cache_salt")}
    plan = await _control("prune_plan", {**plan_body, "token_ids": tokens, "policy": policy})
    ranges = sorted(tuple(r) for r in body["ranges"])
    record = {"prune_id": plan.get("prune_id") or f"prune-blocked-{next(_local_ids)}", "policy": policy,
              "ranges": [list(r) for r in ranges],
              "original_tokens": sum(b - a for a, b in ranges), **plan}
    record["retained_before"] = record.pop("retained_tokens", None)
    PRUNES[record["prune_id"]] = record
    if plan["status"] == "blocked":
        return JSONResponse(record, status_code=200 if body.get("wait") else 202)
    record["retained_tokens"] = record["retained_before"]
    task = asyncio.ensure_future(_run(record, tokens, policy))
    _tasks.add(task)
    task.add_done_callback(_tasks.discard)
    if body.get("wait"):
        await task
        return JSONResponse(record, status_code=200)
    return JSONResponse(record, status_code=202)


async def get_prune(prune_id: str):
    """GET /prune/{prune_id}."""
    record = PRUNES.get(prune_id)
    if record is None:
        raise _http(404, f"unknown pruning job {prune_id!r}")
    return record


async def inspect_prefix(request: Request):
    body = await _body(request)
    return await _control("prefix_inspect", {**body, "token_ids": _token_ids(body)})


async def prefix_priority(request: Request):
    body = await _body(request)
    return await _control("prefix_priority", {"priority": body.get("priority"), "token_ids": _token_ids(body),
                                              "extra_key": body.get("extra_key"), "cache_salt": body.get("cache_salt")})


async def delete_prefix(request: Request):
    body = await _body(request)
    return await _control("prefix_delete", {"token_ids": _token_ids(body), "extra_key": body.get("extra_key"),
                                            "cache_salt": body.get("cache_salt")})


def register_routes(app) -> list[str]:
    app.add_api_route("/prune", prune, methods=["POST"])
    app.add_api_route("/prune/{prune_id}", get_prune, methods=["GET"])
    app.add_api_route("/prefix/inspect", inspect_prefix, methods=["POST"])
    app.add_api_route("/prefix/priority", prefix_priority, methods=["POST"])
    app.add_api_route("/prefix/delete", delete_prefix, methods=["POST"])
    return ["route:/prune", "route:/prune/{id}", "route:/prefix/inspect", "route:/prefix/priority",
            "route:/prefix/delete"]
