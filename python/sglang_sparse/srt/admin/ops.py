"""The admin operations the HTTP process asks a scheduler to run, typed (plain dataclasses).

They ride SGLang's dumper-control round trip (a request type every SGLang process already
knows): ``encode`` gives its ``method`` (``sglang_sparse/<OpName>``) and JSON-able ``body``,
``decode`` rebuilds the operation in the scheduler (``admin/dispatch.py`` runs it). A result is a
dict; ``status >= 400`` with a ``message`` is an error the HTTP side raises.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

METHOD_PREFIX = "sglang_sparse/"


@dataclass(frozen=True)
class ChainDelete:
    """``DELETE /chain/{id}``: drop an idle chain, free its rows."""

    chain_id: str


@dataclass(frozen=True)
class ChainRetention:
    """``GET /chain/{id}/retention``: the logical positions the chain keeps, per layer and KV
    head (``layers``: only those; ``positions``: plain lists besides the runs)."""

    chain_id: str
    layers: list | None = None
    positions: bool = False


@dataclass(frozen=True)
class RequestRetention:
    """``GET /sparse/requests/{rid}/retention``: the same for a running request."""

    rid: str
    layers: list | None = None
    positions: bool = False


@dataclass(frozen=True)
class PrunePlan:
    """``POST /prune`` step 1: check the intervals, remember what they retain. ``prune_id`` is
    minted by the HTTP process, so every data-parallel rank that caches the prefix plans its job
    under the same id."""

    prune_id: str
    token_ids: list
    ranges: list
    policy: str
    keep_ratio: float | None = None
    keep_tokens: int | None = None
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class PruneApply:
    """``POST /prune`` step 3, after the probe ran: apply one keep mask."""

    prune_id: str


@dataclass(frozen=True)
class PruneForget:
    """Drop a planned job whose probe failed."""

    prune_id: str


@dataclass(frozen=True)
class PrefixInspect:
    token_ids: list
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class PrefixPriority:
    token_ids: list
    priority: int
    extra_key: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True)
class PrefixDelete:
    token_ids: list
    extra_key: str | None = None
    cache_salt: str | None = None


OPERATIONS = (ChainDelete, ChainRetention, RequestRetention, PrunePlan, PruneApply, PruneForget, PrefixInspect, PrefixPriority, PrefixDelete)


def encode(op) -> tuple[str, dict]:
    return f"{METHOD_PREFIX}{type(op).__name__}", dataclasses.asdict(op)


def decode(method: str, body: dict):
    """The operation a dumper-control ``method`` (``sglang_sparse/<OpName>``) names, rebuilt from
    ``body``. Raises ValueError for an unknown operation."""
    name = method[len(METHOD_PREFIX):]
    cls = next((c for c in OPERATIONS if c.__name__ == name), None)
    if cls is None:
        raise ValueError(f"unknown sglang_sparse admin operation {name!r}")
    return cls(**body)
