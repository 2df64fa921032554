"""Field checks for request bodies (engine-agnostic: plain JSON values in, a sentence out).

Every check raises ``RequestError(field, message)``: the message names the field, the value it
got (shortened) and what is allowed, and never carries a stack trace or a file path. JSON types
are taken strictly: booleans are not numbers, strings are not numbers, a float is not an
integer. The SGLang adapter turns a ``RequestError`` into SGLang's error body with status 400
(or the error's own status).
"""

from __future__ import annotations

import json
import math
from typing import Any

SHOW_CHARS = 60
# Bodies larger than this are refused (413) by the routes sglang_sparse serves or changes.
MAX_BODY_BYTES = 64 << 20


class RequestError(ValueError):
    """A client error: ``field`` names the offending field (dotted path), ``status`` the HTTP code."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field, self.message, self.status = field, message, status
        self.status_code = status  # what SGLang's error responses read


def show(value: Any) -> str:
    """A short, single-line rendering of a client value for an error message, as JSON."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= SHOW_CHARS else text[: SHOW_CHARS - 3] + "..."


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def expect_int(field: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if not is_int(value):
        raise RequestError(field, f"{field} must be an integer, got {show(value)}")
    _in_range(field, value, low, high)
    return value


def expect_number(field: str, value: Any, low: float | None = None, high: float | None = None) -> float:
    if not is_number(value):
        raise RequestError(field, f"{field} must be a number, got {show(value)}")
    _in_range(field, value, low, high)
    return float(value)


def _in_range(field: str, value, low, high) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        if high is None:
            allowed = f">= {low}"
        elif low is None:
            allowed = f"<= {high}"
        else:
            allowed = f"between {low} and {high}"
        raise RequestError(field, f"{field} must be {allowed}, got {show(value)}")


def expect_bool(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise RequestError(field, f"{field} must be true or false, got {show(value)}")
    return value


def optional_str(field: str, value: Any) -> str | None:
    """A string or null (e.g. ``extra_key``, ``cache_salt``)."""
    if value is not None and not isinstance(value, str):
        raise RequestError(field, f"{field} must be a string or null, got {show(value)}")
    return value


def expect_token_ids(field: str, value: Any, vocab_size: int, max_len: int | None = None) -> list[int]:
    """A non-empty flat list of token ids in ``[0, vocab_size)``."""
    if not isinstance(value, list):
        raise RequestError(field, f"{field} must be a list of token ids, got {show(value)}")
    check_token_ids(field, value, vocab_size)
    if max_len is not None and len(value) > max_len:
        raise RequestError(field, f"{field} has {len(value)} tokens; at most {max_len} (the model's context) "
                                  "are allowed")
    return value


def check_token_ids(field: str, ids: list, vocab_size: int) -> None:
    """``ids`` (a list) holds at least one token and only integers in ``[0, vocab_size)``."""
    if not ids:
        raise RequestError(field, f"{field} is empty: the prompt needs at least one token")
    for i, t in enumerate(ids):
        if not is_int(t) or not 0 <= t < vocab_size:
            raise RequestError(field, f"{field}[{i}] is {show(t)}: token ids must be integers in "
                                      f"[0, {vocab_size}) (the model's vocabulary)")


def expect_messages(field: str, value: Any) -> list[dict]:
    """Chat messages: a non-empty list of ``{"role": str, "content": str | list of text parts}``."""
    if not isinstance(value, list) or not value:
        raise RequestError(field, f"{field} must be a non-empty list of chat messages "
                                  f"({{role, content}}), got {show(value)}")
    for i, m in enumerate(value):
        at = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(at, f"{at} must be an object with role and content, got {show(m)}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise RequestError(f"{at}.role", f"{at}.role must be a non-empty string, got {show(m.get('role'))}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise RequestError(f"{at}.content[{j}]", f"{at}.content[{j}] must be a text part "
                                                              f'{{"type": "text", "text": ...}}, got {show(part)}')
        elif not isinstance(content, str):
            raise RequestError(f"{at}.content", f"{at}.content must be a string or a list of text parts, "
                                                f"got {show(content)}")
    return value


def expect_chain_id(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value or len(value) > 256:
        raise RequestError(field, f"{field} must be a non-empty string of at most 256 characters (the chain_id "
                                  f"of an earlier response), got {show(value)}")
    return value
