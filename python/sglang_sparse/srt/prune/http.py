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

Each step runs in the scheduler as a typed admin operation (``admin/ops.py``, ``admin.http.call``);
the scoring probe is an ordinary generation request (``prune/scheduler.py``).
"""

from __future__ import annotations

import asyncio

from fastapi import Request  # the handlers' annotation (FastAPI resolves it by name)

from sglang_sparse.core.pruning import POLICIES
from sglang_sparse.srt import metrics
from sglang_sparse.srt.admin import ops
from sglang_sparse.srt.admin.http import admin_route, call, call_all, json_body, pick_rank_result, raise_refusal
from sglang_sparse.srt.state import STATE
from sglang_sparse.validation import (RequestError, expect_bool, expect_int, expect_messages,
                                      expect_number, expect_token_ids, is_int, optional_str, show)

KEEP_RECORDS = 1024  # /prune job records kept for GET /prune/{id} (the newest)


def _tokenizer_manager():
    from sglang.srt.entrypoints.http_server import get_global_state

    return get_global_state().tokenizer_manager


def _token_ids(body: dict) -> list[int]:
    """The cached sequence, from exactly one of token_ids, text, messages."""
    given = [k for k in ("token_ids", "text", "messages") if body.get(k) is not None]
    if len(given) != 1:
        raise RequestError("token_ids", "name the cached sequence with exactly one of token_ids, text or messages"
                                        + (f" (got {', '.join(given)})" if given else ""))
    tm = _tokenizer_manager()
    if given[0] == "token_ids":
        return expect_token_ids("token_ids", body["token_ids"], tm.model_config.vocab_size, tm.context_len)
    if given[0] == "text":
        if not isinstance(body["text"], str):
            raise RequestError("text", f"text must be a string, got {show(body['text'])}")
        return list(tm.tokenizer.encode(body["text"]))
    messages = expect_messages("messages", body["messages"])
    try:
        ids = tm.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    except Exception as err:  # noqa: BLE001 - the template's own complaint, shortened
        raise RequestError("messages", f"the chat template cannot render these messages ({type(err).__name__}: "
                                       f"{show(str(err))})") from None
    # transformers 5 returns a BatchEncoding here, earlier versions a list of ids
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _namespace(body: dict) -> dict:
    return {k: optional_str(k, body.get(k)) for k in ("extra_key", "cache_salt")}


def _ranges(raw) -> list[list[int]]:
    """``[[L, R], ...]`` as integer pairs (the scheduler checks them against the sequence)."""
    if not isinstance(raw, list) or not raw:
        raise RequestError("ranges", f"ranges must be a non-empty list of [L, R] intervals, got {show(raw)}")
    for i, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 2 and all(is_int(x) for x in item)):
            raise RequestError(f"ranges[{i}]", f"ranges[{i}] must be a pair of integers [L, R], got {show(item)}")
    return raw


def _target(body: dict) -> dict:
    """keep_ratio (a number in [0, 1]) or keep_tokens (an integer >= 0), exactly one."""
    ratio, tokens = body.get("keep_ratio"), body.get("keep_tokens")
    if (ratio is None) == (tokens is None):
        raise RequestError("keep_ratio", "give exactly one of keep_ratio (a number in [0, 1]) and keep_tokens "
                                         "(an integer >= 0)")
    if ratio is not None:
        return {"keep_ratio": expect_number("keep_ratio", ratio, 0, 1), "keep_tokens": None}
    return {"keep_ratio": None, "keep_tokens": expect_int("keep_tokens", tokens, 0)}


def _probe_ids(plan: dict, tokens: list[int], policy: str) -> list[int]:
    """The probe's prompt: snapkv re-reads the sequence (its tail is recomputed as the
    observation window); kvzip appends "repeat the context" + each interval's tokens."""
    if policy == "snapkv":
        return list(tokens)
    from sglang_sparse.core.pruning import kvzip_prompt_ids

    tokenizer = _tokenizer_manager().tokenizer
    prompt, _ = kvzip_prompt_ids(lambda text: tokenizer.encode(text, add_special_tokens=False))
    ids = list(tokens) + prompt
    for left, right in plan["ranges"]:
        ids += tokens[left:right]
    return ids


async def _probe(record: dict, ids: list[int], rank: int | None) -> None:
    """Prefill the probe on one data-parallel rank (``rank`` None: one scheduler)."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_sparse.srt.prune.job import PROBE_KEY

    pid = record["prune_id"]
    probe = GenerateReqInput(
        input_ids=ids, rid=f"{pid}-probe" if rank is None else f"{pid}-probe-r{rank}",
        sampling_params={"max_new_tokens": 1, "temperature": 0, "custom_params": {PROBE_KEY: pid}})
    if rank is not None:
        probe.routed_dp_rank = rank  # the job lives on that rank's scheduler, with its cached prefix
    async for _ in _tokenizer_manager().generate_request(probe, None):
        pass


def _merge(applied: list[dict]) -> dict:
    """One record from the ranks that applied the job: freed slots add up; retained tokens are
    each rank's copy of the prefix (the same mask rule, each over its own scores)."""
    if len(applied) == 1:
        return applied[0]
    done = all(r.get("status") == "completed" for r in applied)
    out = {"status": "completed" if done else "failed", "per_rank": applied,
           "freed_slots": sum(r.get("freed_slots", 0) for r in applied)}
    if done:
        out["retained_tokens"] = applied[0]["retained_tokens"]
    else:
        out["reason"] = next(r.get("reason") for r in applied if r.get("status") != "completed")
    return out


async def _run(record: dict, tokens: list[int], policy: str, ranks: list[int] | None) -> None:
    """Probe, then apply, on every rank that planned the job (``ranks`` None: one scheduler)."""
    pid = record["prune_id"]
    record["status"] = "running"
    metrics.prune_jobs_changed(STATE.http.prunes.values())
    try:
        ids = _probe_ids(record, tokens, policy)
        await asyncio.gather(*(_probe(record, ids, r) for r in (ranks or [None])))
        results = await call_all(ops.PruneApply(pid))
        if ranks is None:
            record.update(raise_refusal(results[0]))
            record.pop("dp_rank", None)
        else:  # the ranks that held the job (the others answer 404, unknown job)
            applied = sorted((r for r in results if r.get("dp_rank") in ranks), key=lambda r: r["dp_rank"])
            record.update(_merge(applied) if applied else raise_refusal(pick_rank_result(results)))
        metrics.prune_jobs_changed(STATE.http.prunes.values())
    except Exception as err:  # noqa: BLE001 - reported in the record
        record.update(status="failed", reason=getattr(err, "message", None) or type(err).__name__)
        try:
            await call(ops.PruneForget(pid))
        except Exception:  # noqa: BLE001
            pass
        metrics.prune_jobs_changed(STATE.http.prunes.values())


@admin_route
async def prune(request: Request):
    """POST /prune."""
    from fastapi.responses import JSONResponse

    body = await json_body(request)
    tokens = _token_ids(body)
    policy = body.get("policy", "kvzip")
    if not isinstance(policy, str) or policy not in POLICIES:
        raise RequestError("policy", f"unknown policy {show(policy)}: policy must be one of {', '.join(POLICIES)}")
    wait = expect_bool("wait", body.get("wait", False))
    ranges = _ranges(body.get("ranges"))
    pid = f"prune-{next(STATE.http.prune_ids)}"
    plans = await call_all(ops.PrunePlan(pid, tokens, ranges, policy, **_target(body), **_namespace(body)))
    # with --dp-size N every rank has its own radix tree: the job runs on each rank that caches the
    # prefix (its probe routed there); a rank without it refuses (404) and is left out
    queued = sorted((p for p in plans if p.get("status") == "queued"), key=lambda p: p["dp_rank"])
    planned = [p["dp_rank"] for p in queued]
    plan = queued[0] if queued else raise_refusal(pick_rank_result(plans))
    ranks = planned if len(plans) > 1 else None
    ranges = sorted(tuple(r) for r in ranges)
    record = {"prune_id": pid if planned else f"prune-blocked-{next(STATE.http.local_ids)}", "policy": policy,
              "ranges": [list(r) for r in ranges],
              "original_tokens": sum(b - a for a, b in ranges), **plan}
    record.pop("dp_rank", None)
    if ranks is not None:
        record["dp_ranks"] = ranks
    record["retained_before"] = record.pop("retained_tokens", None)
    prunes = STATE.http.prunes
    prunes[record["prune_id"]] = record
    while len(prunes) > KEEP_RECORDS:
        del prunes[next(iter(prunes))]
    metrics.prune_jobs_changed(STATE.http.prunes.values())
    if plan["status"] == "blocked":
        return JSONResponse(record, status_code=200 if wait else 202)
    record["retained_tokens"] = record["retained_before"]
    task = asyncio.ensure_future(_run(record, tokens, policy, ranks))
    STATE.http.prune_tasks.add(task)
    task.add_done_callback(STATE.http.prune_tasks.discard)
    if wait:
        await task
        return JSONResponse(record, status_code=200)
    return JSONResponse(record, status_code=202)


@admin_route
async def get_prune(prune_id: str):
    """GET /prune/{prune_id}."""
    record = STATE.http.prunes.get(prune_id)
    if record is None:
        raise RequestError("prune_id", f"unknown pruning job {show(prune_id)}", status=404)
    return record


@admin_route
async def inspect_prefix(request: Request):
    body = await json_body(request)
    return await call(ops.PrefixInspect(_token_ids(body), **_namespace(body)))


@admin_route
async def prefix_priority(request: Request):
    body = await json_body(request)
    priority = expect_int("priority", body.get("priority"))
    return await call(ops.PrefixPriority(_token_ids(body), priority, **_namespace(body)))


@admin_route
async def delete_prefix(request: Request):
    body = await json_body(request)
    return await call(ops.PrefixDelete(_token_ids(body), **_namespace(body)))
