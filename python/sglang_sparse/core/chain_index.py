"""ChainCacheIndex: which agent sessions (chains) hold retained KV and method state between turns
(engine-agnostic; the paper's section 3.2 and appendix B.2).

A chain record holds its id, status, a fingerprint of model + method + knobs, the *processed
boundary* (how many logical tokens went through the model, and a digest of exactly those
tokens), the compact logical token ids up to the boundary, and an opaque payload (retained
per-layer KV rows + method metadata) with the rows it holds.

```
            start()                park(boundary, payload)
  (none) ──────────────▶ ACTIVE ─────────────────────────▶ IDLE ──┐
                           ▲  │ invalidate() (cancel, fail,        │ resume() with the same
                           │  │ preempt): payload released         │ fingerprint and a prompt
                           │  ▼                                    │ that extends the boundary
                       INVALIDATED ◀── invalidate()/delete() ──────┤
                                                                   │ reclaim() (LRU, idle only):
                           ACTIVE ◀────────────────────────────────┘ payload released -> RECLAIMED
```

Boundary rule: the last sampled token of a turn has no KV yet (it never went through the model),
so it is *not* inside the boundary; the continuation prefills it with its new suffix.

Errors carry the HTTP status the server answers with: unknown id 404, busy or mismatch 409,
reclaimed or invalidated 410, a continuation this server can never take (too many tokens for
its maximum input length or its KV pool) 400, no capacity for now 503.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


class ChainError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownChain(ChainError):
    status = 404


class ChainBusy(ChainError):
    status = 409


class ChainMismatch(ChainError):
    status = 409


class ChainGone(ChainError):
    status = 410


class NoChainCapacity(ChainError):
    status = 503


class ContinuationTooLarge(ChainError):
    """A continuation no state of the server can take: it is the client's to shorten (400)."""
    status = 400


# Chain ids: ``chain-[<replica>-][r<k>-]<n>``. ``<replica>`` names the server (``--chain-replica``,
# for several servers behind one router), ``r<k>`` the data-parallel rank of one server's
# schedulers (only with more than one), ``<n>`` the scheduler's counter.
REPLICA_NAME_RULE = "1 to 16 lowercase letters and digits, starting with a letter, not r<digits>"


def valid_replica_name(name: str) -> bool:
    """Whether ``name`` can be a replica name in chain ids (see ``REPLICA_NAME_RULE``)."""
    return (0 < len(name) <= 16 and name.isascii() and name.isalnum() and name == name.lower()
            and name[0].isalpha() and not _is_rank(name))


def _is_rank(part: str) -> bool:
    return part[:1] == "r" and part[1:].isdigit()


def parse_chain_id(chain_id: str) -> tuple[str | None, int | None] | None:
    """``(replica, dp_rank)`` named by a chain id of this project (either may be None), or None
    for any other id (a session's chain, a client's own name)."""
    parts = chain_id.split("-")
    if len(parts) < 2 or len(parts) > 4 or parts[0] != "chain" or not parts[-1].isdigit():
        return None
    middle, replica, rank = parts[1:-1], None, None
    if middle and _is_rank(middle[-1]):
        rank = int(middle.pop()[1:])
    if middle:
        replica = middle.pop()
        if not valid_replica_name(replica):
            return None
    return (replica, rank) if not middle else None


def dp_rank_of(chain_id: str) -> int | None:
    """The data-parallel rank named by a chain id ``chain-[<replica>-]r<k>-<n>`` (None for any other id)."""
    parsed = parse_chain_id(chain_id)
    return parsed[1] if parsed else None


# Named chains: an SGLang session's, and a routing key's (sglang-router's X-SMG-Routing-Key, copied
# by the HTTP process into ``custom_params[CHAIN_KEY]``).
CHAIN_KEY = "chain_key"
KEY_CHAIN_PREFIX = "key-"


def session_chain_id(session_id: str) -> str:
    return f"session-{session_id}"


def key_chain_id(key: str) -> str:
    return KEY_CHAIN_PREFIX + key


def key_of_chain(chain_id: str) -> str | None:
    """The routing key a chain id names (``key-<K>``), or None."""
    return chain_id[len(KEY_CHAIN_PREFIX):] if chain_id.startswith(KEY_CHAIN_PREFIX) else None


def chain_id_prefix(replica: str | None, dp_rank: int | None) -> str:
    """The prefix of new chain ids on one scheduler: ``chain-``, ``chain-<replica>-``,
    ``chain-r<k>-`` or ``chain-<replica>-r<k>-`` (``dp_rank`` only with several ranks)."""
    return "chain-" + (f"{replica}-" if replica else "") + (f"r{dp_rank}-" if dp_rank is not None else "")


class ChainStatus(enum.Enum):
    ACTIVE = "active"
    IDLE = "idle"
    RECLAIMED = "reclaimed"
    INVALIDATED = "invalidated"


def token_digest(tokens: Sequence[int]) -> str:
    """sha256 of the token ids (little-endian int64), the boundary's identity."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(int(t).to_bytes(8, "little", signed=True))
    return h.hexdigest()


def fingerprint(model: str, method: str, options: dict) -> str:
    """What must not change for retained state to stay valid: model, method and its knobs."""
    blob = json.dumps({"model": model, "method": method, "options": options}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass
class ChainRecord:
    chain_id: str
    fingerprint: str
    status: ChainStatus = ChainStatus.ACTIVE
    tokens: tuple[int, ...] = ()  # logical token ids [0, boundary)
    digest: str = field(default_factory=lambda: token_digest(()))
    payload: Any = None  # retained KV rows + method metadata, owned while ACTIVE/IDLE
    rows: int = 0  # KV rows the payload holds (capacity accounting)
    last_use: int = 0
    reason: str = ""  # why the chain was reclaimed or invalidated

    @property
    def boundary(self) -> int:
        return len(self.tokens)

    def describe(self) -> dict:
        return {"chain_id": self.chain_id, "status": self.status.value, "processed_tokens": self.boundary,
                "retained_rows": self.rows, "last_use": self.last_use, "fingerprint": self.fingerprint,
                **({"reason": self.reason} if self.reason else {})}


class ChainCacheIndex:
    """Chains of one scheduler. ``release(payload)`` gives a payload's rows and metadata back
    (called exactly once per payload: on reclaim, invalidation, deletion or replacement)."""

    def __init__(self, release: Callable[[Any], None], id_prefix: str = "chain-") -> None:
        """``id_prefix``: new chains are ``<prefix><n>`` (``chain-r<k>-`` under data parallelism:
        ids unique across ranks, and the rank that holds a chain is in its id)."""
        self.release = release
        self.id_prefix = id_prefix
        self.chains: dict[str, ChainRecord] = {}
        self._clock = itertools.count(1)
        self._ids = itertools.count(1)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, fingerprint: str, chain_id: str | None = None) -> ChainRecord:
        """A request without a chain id starts a new chain (ACTIVE, nothing processed yet)."""
        chain_id = chain_id or f"{self.id_prefix}{next(self._ids)}"
        if chain_id in self.chains:
            raise ChainBusy(f"chain {chain_id} already exists")
        rec = ChainRecord(chain_id, fingerprint, last_use=next(self._clock))
        self.chains[chain_id] = rec
        return rec

    def get(self, chain_id: str) -> ChainRecord:
        rec = self.chains.get(chain_id)
        if rec is None:
            raise UnknownChain(self._unknown(chain_id))
        return rec

    def _unknown(self, chain_id: str) -> str:
        """Why ``chain_id`` is not here: a chain another replica started says which one."""
        ours, theirs = parse_chain_id(self.id_prefix + "0"), parse_chain_id(chain_id)
        # only a named replica says where a chain lives (on a lone server ``chain-x-1`` is
        # just an unknown id, not necessarily another server's)
        if ours is not None and ours[0] and theirs is not None and theirs[0] != ours[0]:
            where = f"replica {theirs[0]}" if theirs[0] else "a server without --chain-replica"
            here = f"replica {ours[0]}"
            return (f"unknown chain {chain_id!r}: it was started on {where} and this is {here}; send a "
                    "chain's continuations to the server that holds it (behind sglang-router: "
                    "--policy manual and the same X-SMG-Routing-Key header as the chain's first turn)")
        return f"unknown chain {chain_id!r}"

    def check_continuation(self, chain_id: str, fingerprint: str, tokens: Sequence[int]) -> ChainRecord:
        """Raise unless ``tokens`` may resume ``chain_id``: the chain is idle, the fingerprint
        matches and ``tokens`` extend the processed prefix exactly (at least one new token)."""
        rec = self.get(chain_id)
        if rec.status in (ChainStatus.RECLAIMED, ChainStatus.INVALIDATED):
            raise ChainGone(f"chain {chain_id} was {rec.status.value} ({rec.reason}); start a new chain")
        if rec.status is ChainStatus.ACTIVE:
            raise ChainBusy(f"chain {chain_id} is in use by another request")
        if fingerprint != rec.fingerprint:
            raise ChainMismatch(f"chain {chain_id} was built with another model, method or settings "
                                f"(fingerprint {rec.fingerprint}, this server {fingerprint})")
        n = rec.boundary
        diverge = next((i for i, (a, b) in enumerate(zip(rec.tokens, tokens)) if a != b), None)
        if diverge is not None:
            raise ChainMismatch(f"chain {chain_id}: the prompt diverges from the chain's processed "
                                f"prefix at token {diverge} (of {n} processed tokens)")
        if len(tokens) <= n:
            raise ChainMismatch(f"chain {chain_id}: the prompt has {len(tokens)} tokens; it must extend "
                                f"the {n} processed tokens by at least one")
        return rec

    def resume(self, chain_id: str, fingerprint: str, tokens: Sequence[int]) -> ChainRecord:
        """Checked continuation: the chain becomes ACTIVE with its payload attached to the request."""
        rec = self.check_continuation(chain_id, fingerprint, tokens)
        rec.status = ChainStatus.ACTIVE
        rec.last_use = next(self._clock)
        return rec

    def park(self, chain_id: str, processed: Sequence[int], payload: Any, rows: int) -> ChainRecord:
        """The request ended normally: keep ``payload`` for the processed tokens (the boundary
        excludes a final sampled token without KV). The chain becomes IDLE."""
        rec = self.get(chain_id)
        if rec.status is not ChainStatus.ACTIVE:
            raise ChainBusy(f"chain {chain_id} is {rec.status.value}, not active")
        if rec.payload is not None and rec.payload is not payload:
            self.release(rec.payload)  # the turn produced a new payload; the old one goes
        rec.tokens, rec.digest = tuple(processed), token_digest(processed)
        rec.payload, rec.rows = payload, rows
        rec.status, rec.last_use = ChainStatus.IDLE, next(self._clock)
        return rec

    def invalidate(self, chain_id: str, reason: str) -> None:
        """Cancellation, failure or preemption: payload and metadata go together."""
        rec = self.chains.get(chain_id)
        if rec is None or rec.status in (ChainStatus.RECLAIMED, ChainStatus.INVALIDATED):
            return
        self._drop(rec, ChainStatus.INVALIDATED, reason)

    def delete(self, chain_id: str) -> None:
        """Admin delete (``DELETE /chain/{id}``): only a chain no request is using."""
        rec = self.get(chain_id)
        if rec.status is ChainStatus.ACTIVE:
            raise ChainBusy(f"chain {chain_id} is in use by a running request")
        if rec.payload is not None:
            self.release(rec.payload)
        del self.chains[chain_id]

    def forget_all(self, reason: str) -> None:
        """The engine dropped every KV slot at once (cache flush): payloads are gone already,
        so chains are invalidated without releasing anything."""
        for rec in self.chains.values():
            if rec.status not in (ChainStatus.RECLAIMED, ChainStatus.INVALIDATED):
                rec.payload, rec.rows, rec.status, rec.reason = None, 0, ChainStatus.INVALIDATED, reason

    # -- capacity ----------------------------------------------------------------------------------
    def idle_rows(self) -> int:
        return sum(r.rows for r in self.chains.values() if r.status is ChainStatus.IDLE)

    def reclaim(self, rows_needed: int) -> int:
        """Free idle chains, least recently used first, until ``rows_needed`` rows are freed or
        no idle chain is left. Active chains are never touched. Returns rows freed."""
        freed = 0
        for rec in sorted((r for r in self.chains.values() if r.status is ChainStatus.IDLE),
                          key=lambda r: r.last_use):
            if freed >= rows_needed:
                break
            freed += rec.rows
            self._drop(rec, ChainStatus.RECLAIMED, "reclaimed for capacity (least recently used idle chain)")
        return freed

    def reserve(self, rows_needed: int, rows_free: int) -> None:
        """Make ``rows_needed`` rows available given ``rows_free``: reclaim idle chains or raise
        NoChainCapacity (503) when even all idle chains would not be enough."""
        if rows_free >= rows_needed:
            return
        if rows_free + self.idle_rows() < rows_needed:
            raise NoChainCapacity(f"{rows_needed} KV rows needed, {rows_free} free and "
                                  f"{self.idle_rows()} held by idle chains")
        self.reclaim(rows_needed - rows_free)

    def _drop(self, rec: ChainRecord, status: ChainStatus, reason: str) -> None:
        if rec.payload is not None:
            self.release(rec.payload)
        rec.payload, rec.rows, rec.status, rec.reason = None, 0, status, reason
