"""What every admin route of sglang_sparse shares (HTTP process): reading the JSON body, the
error body, and ``call``, the one round trip of an admin operation to the scheduler.

Errors are SGLang's ``ErrorResponse`` body, as its ``HTTPException`` handler renders it
(``{"object": "error", "message", "type", "param", "code"}``; ``param`` names the field); a
handler raises ``RequestError`` (``sglang_sparse.validation``) and ``admin_route`` turns it into
that response. Anything unexpected becomes a 500 whose message
names the operation, never a stack trace.
"""

from __future__ import annotations

import functools
import logging

from sglang_sparse.srt.admin import ops
from sglang_sparse.validation import MAX_BODY_BYTES, RequestError

logger = logging.getLogger("sglang_sparse")

def error_response(status: int, message: str, param: str | None = None):
    """SGLang's ``ErrorResponse`` (what its HTTPException handler answers)."""
    from fastapi.responses import JSONResponse

    return JSONResponse({"object": "error", "message": message, "type": str(status), "param": param or None,
                         "code": status}, status_code=status)


def generate_error_response(status: int, message: str, param: str | None = None):
    """An error of ``/generate`` as SGLang answers it: a 400 (a ValueError there) in its
    ``_create_error_response`` body ``{"error": {"message": ...}}``, other statuses (an
    HTTPException) as ``ErrorResponse``."""
    if status != 400:
        return error_response(status, message, param)
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message}}, status_code=400)


def admin_route(handler):
    """Wrap an async route handler: RequestError -> its status and sentence."""

    @functools.wraps(handler)
    async def wrapped(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except RequestError as err:
            return error_response(err.status, err.message, err.field)
        except Exception:  # noqa: BLE001 - logged; the client gets a sentence, not a trace
            logger.exception("sglang_sparse: %s failed", handler.__name__)
            return error_response(500, f"{handler.__name__} failed inside sglang_sparse; the server log has the details")

    return wrapped


async def json_body(request) -> dict:
    """The request's JSON object (400 if it is not JSON or not an object, 413 if too large)."""
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError("body", f"the request body has {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted",
                           status=413)
    try:
        body = await request.json()
    except Exception:
        raise RequestError("body", "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError("body", "the request body must be a JSON object")
    return body


async def call_all(op) -> list[dict]:
    """Run an admin operation (``admin/ops.py``) on every data-parallel rank; their results in
    rank order (refusals included, as ``{"status": code, "message": ...}``)."""
    from sglang.srt.entrypoints.http_server import get_global_state
    from sglang.srt.managers.io_struct import DumperControlReqInput

    method, body = ops.encode(op)
    outs = await get_global_state().tokenizer_manager.dumper_control(DumperControlReqInput(method=method, body=body))
    results = []
    for out in outs:  # one per data-parallel rank (the operation ran on each)
        if not out.success or not out.response:
            logger.error("sglang_sparse: admin operation %s failed in the scheduler: %s", method, out.error)
            raise RequestError("", f"the admin operation {type(op).__name__} failed in the scheduler; the server "
                                   "log has the details", status=500)
        results.append(out.response[0])
    return results


def refused(result: dict) -> bool:
    return isinstance(result.get("status"), int) and result["status"] >= 400


def raise_refusal(result: dict) -> dict:
    """``result`` unless it is a refusal: then the RequestError it carries."""
    if refused(result):
        raise RequestError(result.get("param") or "", result["message"], status=result["status"])
    return result


async def call(op) -> dict:
    """Run an admin operation in the scheduler(s) and return the answer of the rank that did
    something (``pick_rank_result``); a refusal is raised as RequestError."""
    return raise_refusal(pick_rank_result(await call_all(op)))


def pick_rank_result(results: list[dict]) -> dict:
    """The answer of the rank that did something: the first success; else the most specific
    refusal (a rank that holds the object, e.g. 409 busy or 410 gone, over the 404s of the ranks
    that do not know it)."""
    ok = [r for r in results if not refused(r)]
    if ok:
        return ok[0]
    known = [r for r in results if r["status"] != 404]
    return (known or results)[0]
