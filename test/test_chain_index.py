"""ChainCacheIndex (engine-agnostic): continuation rules with their HTTP codes, LRU reclaim of
idle chains only, and a property test that no payload is ever leaked or released twice."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_sparse.core.chain_index import (
    ChainBusy, ChainCacheIndex, ChainGone, ChainMismatch, ChainStatus, NoChainCapacity, UnknownChain,
    fingerprint, token_digest,
)

FP = fingerprint("smollm2", "snapkv", {"budget": 64})


def index():
    released = []
    return ChainCacheIndex(released.append), released


def test_continuation_rules_and_codes():
    idx, released = index()
    rec = idx.start(FP)
    idx.park(rec.chain_id, [1, 2, 3, 4], payload="p1", rows=3)
    assert rec.status is ChainStatus.IDLE and rec.boundary == 4 and rec.digest == token_digest([1, 2, 3, 4])
    cases = [
        (lambda: idx.check_continuation("nope", FP, [1]), UnknownChain, 404, "unknown chain 'nope'"),
        (lambda: idx.check_continuation(rec.chain_id, "other", [1, 2, 3, 4, 5]), ChainMismatch, 409,
         "another model, method or settings"),
        (lambda: idx.check_continuation(rec.chain_id, FP, [1, 2, 9, 4, 5]), ChainMismatch, 409,
         "diverges from the chain's processed prefix at token 2 \\(of 4 processed tokens\\)"),
        (lambda: idx.check_continuation(rec.chain_id, FP, [1, 2, 3, 4]), ChainMismatch, 409,
         "must extend the 4 processed tokens"),
    ]
    for call, err, status, msg in cases:
        with pytest.raises(err, match=msg) as info:
            call()
        assert info.value.status == status
    idx.resume(rec.chain_id, FP, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ChainBusy) as info:  # a second request on the same chain
        idx.resume(rec.chain_id, FP, [1, 2, 3, 4, 5, 6])
    assert info.value.status == 409
    with pytest.raises(ChainBusy):
        idx.delete(rec.chain_id)
    idx.park(rec.chain_id, [1, 2, 3, 4, 5, 6, 7], payload="p2", rows=5)
    assert released == ["p1"]  # the turn's new payload replaced the old one
    idx.invalidate(rec.chain_id, "cancelled by the client")
    assert released == ["p1", "p2"]
    with pytest.raises(ChainGone, match="invalidated \\(cancelled by the client\\)") as info:
        idx.resume(rec.chain_id, FP, [1, 2, 3, 4, 5, 6, 7, 8])
    assert info.value.status == 410


def test_reclaim_takes_idle_chains_in_lru_order_and_never_active_ones():
    idx, released = index()
    ids = []
    for i in range(4):
        rec = idx.start(FP)
        idx.park(rec.chain_id, [i, i + 1], payload=f"p{i}", rows=10)
        ids.append(rec.chain_id)
    idx.resume(ids[0], FP, [0, 1, 2])  # the oldest chain is active again
    idx.resume(ids[2], FP, [2, 3, 4])
    idx.park(ids[2], [2, 3, 4], payload="p2b", rows=10)  # chain 2 is now the most recent idle one
    assert idx.reclaim(15) == 20  # chains 1, then 3 (LRU among idle); chain 0 is active
    assert released == ["p2", "p1", "p3"]
    assert idx.get(ids[0]).status is ChainStatus.ACTIVE
    assert idx.get(ids[1]).status is ChainStatus.RECLAIMED and idx.get(ids[2]).status is ChainStatus.IDLE
    with pytest.raises(ChainGone, match="reclaimed"):
        idx.resume(ids[1], FP, [1, 2, 3])
    with pytest.raises(NoChainCapacity, match="100 KV rows needed, 5 free and 10 held by idle chains") as info:
        idx.reserve(100, rows_free=5)
    assert info.value.status == 503  # (the index's reserve(); the server answers 400 for what never fits)
    idx.reserve(12, rows_free=5)  # enough with chain 2's 10 rows
    assert idx.get(ids[2]).status is ChainStatus.RECLAIMED


class ChainMachine(RuleBasedStateMachine):
    """Random starts, parks, resumes, invalidations, deletes and reclaims; after every step each
    payload is either held by exactly one live chain or released exactly once."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[str] = []
        self.idx = ChainCacheIndex(self.released.append)
        self.made: list[str] = []  # every payload ever handed to the index
        self.n = 0

    def _payload(self) -> str:
        self.n += 1
        self.made.append(f"p{self.n}")
        return self.made[-1]

    def _with(self, status):
        return [r.chain_id for r in self.idx.chains.values() if r.status is status]

    @rule()
    def start(self):
        self.idx.start(FP)

    @precondition(lambda self: self._with(ChainStatus.ACTIVE))
    @rule(data=st.data(), extra=st.integers(1, 5), rows=st.integers(0, 50))
    def park(self, data, extra, rows):
        cid = data.draw(st.sampled_from(self._with(ChainStatus.ACTIVE)))
        rec = self.idx.get(cid)
        self.idx.park(cid, list(rec.tokens) + list(range(extra)), self._payload(), rows)

    @precondition(lambda self: self._with(ChainStatus.IDLE))
    @rule(data=st.data(), ok=st.booleans())
    def resume(self, data, ok):
        cid = data.draw(st.sampled_from(self._with(ChainStatus.IDLE)))
        rec = self.idx.get(cid)
        tokens = list(rec.tokens) + [7] if ok else [-1] + list(rec.tokens)
        if ok:
            self.idx.resume(cid, FP, tokens)
        else:
            with pytest.raises(ChainMismatch):
                self.idx.resume(cid, FP, tokens)
            assert rec.status is ChainStatus.IDLE  # a refused continuation changes nothing

    @precondition(lambda self: self.idx.chains)
    @rule(data=st.data())
    def invalidate(self, data):
        self.idx.invalidate(data.draw(st.sampled_from(sorted(self.idx.chains))), "aborted")

    @precondition(lambda self: self._with(ChainStatus.IDLE) or self._with(ChainStatus.RECLAIMED))
    @rule(data=st.data())
    def delete(self, data):
        self.idx.delete(data.draw(st.sampled_from(self._with(ChainStatus.IDLE) + self._with(ChainStatus.RECLAIMED))))

    @rule(rows=st.integers(0, 120))
    def reclaim(self, rows):
        active = {c: self.idx.get(c).payload for c in self._with(ChainStatus.ACTIVE)}
        idle = sorted((r.last_use, r.chain_id) for r in self.idx.chains.values() if r.status is ChainStatus.IDLE)
        self.idx.reclaim(rows)
        for c, p in active.items():  # active chains keep everything
            assert self.idx.get(c).status is ChainStatus.ACTIVE and self.idx.get(c).payload is p
        still = [self.idx.get(c).status is ChainStatus.IDLE for _, c in idle]
        assert still == sorted(still), "a more recently used idle chain went before an older one"

    @invariant()
    def every_payload_held_once_or_released_once(self):
        held = [r.payload for r in self.idx.chains.values() if r.payload is not None]
        assert len(set(self.released)) == len(self.released), "a payload was released twice"
        assert not set(held) & set(self.released)
        assert sorted(held + self.released) == sorted(self.made)
        for r in self.idx.chains.values():
            if r.status in (ChainStatus.RECLAIMED, ChainStatus.INVALIDATED):
                assert r.payload is None and r.rows == 0


TestChainMachine = ChainMachine.TestCase
TestChainMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_chain_ids_carry_the_data_parallel_rank():
    from sglang_sparse.core.chain_index import dp_rank_of

    idx = ChainCacheIndex(lambda p: None, id_prefix="chain-r1-")
    cid = idx.start("fp").chain_id
    assert cid == "chain-r1-1" and dp_rank_of(cid) == 1
    assert dp_rank_of("chain-7") is None and dp_rank_of("session-r1-2") is None and dp_rank_of("chain-rx-1") is None
    assert ChainCacheIndex(lambda p: None).start("fp").chain_id == "chain-1"


def test_chain_ids_carry_the_replica_and_say_where_a_foreign_chain_lives():
    from sglang_sparse.core.chain_index import (UnknownChain, chain_id_prefix, dp_rank_of, parse_chain_id,
                                                valid_replica_name)

    assert chain_id_prefix("a", None) == "chain-a-" and chain_id_prefix("a", 1) == "chain-a-r1-"
    assert chain_id_prefix(None, None) == "chain-" and chain_id_prefix(None, 0) == "chain-r0-"
    assert parse_chain_id("chain-a-r1-3") == ("a", 1) and dp_rank_of("chain-a-r1-3") == 1
    assert parse_chain_id("chain-b2-7") == ("b2", None) and parse_chain_id("chain-7") == (None, None)
    for other in ("chain-A-1", "chain-a-b-1", "chain-a-r1-x", "session-a-1", "chain--1", "chain-a-r1-r2-1"):
        assert parse_chain_id(other) is None, other
    assert not valid_replica_name("r1") and not valid_replica_name("1a") and valid_replica_name("rx")
    here = ChainCacheIndex(lambda p: None, id_prefix=chain_id_prefix("a", None))
    assert here.start("fp").chain_id == "chain-a-1"
    try:
        here.get("chain-b-1")
        raise AssertionError("a chain of replica b must be unknown on replica a")
    except UnknownChain as err:
        assert err.status == 404 and "started on replica b and this is replica a" in err.message
    try:
        ChainCacheIndex(lambda p: None).get("chain-missing-1")  # a lone server: no replica talk
        raise AssertionError("never started")
    except UnknownChain as err:
        assert err.message == "unknown chain 'chain-missing-1'"
    try:
        here.get("chain-a-9")
        raise AssertionError("chain-a-9 was never started")
    except UnknownChain as err:
        assert err.message == "unknown chain 'chain-a-9'"
