"""What a chain holds between turns, and what a request knows of its chain (plain dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_sparse.core.retained import RetainedMap


@dataclass
class Parked:
    """An evicting method's chain payload: SGLang's KV record (a ``req_to_token`` row holding
    rows ``[0, rows)``) and the method's view of those rows (retained map + metadata)."""

    kv: Any  # SGLang's ReqKvInfo, detached from the finished request
    retained: RetainedMap
    metadata: dict


@dataclass
class Pinned:
    """A full-KV chain's payload (radix tree on): a lock on the tree path that holds the chain's
    processed prefix, so the prefix is not evicted while the chain is idle. A continuation then
    matches through the tree like any request."""

    cache: Any  # the SparseRadixCache
    node: Any  # the last node of the pinned path
    retained: int
    tokens: int  # logical tokens of the pinned path (the boundary rounded down to KV pages)


@dataclass
class ReqChain:
    """What a request knows of its chain (``req.sparse.chain``)."""

    chain_id: str
    status: str  # "created" | "resumed"
    reused: int  # logical tokens taken from the chain (its processed boundary)
    lent: Parked | None = None  # the resumed payload, owned by the request once lent
