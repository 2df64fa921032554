"""The logical radix tree against SGLang 0.5.23's own ``RadixCache`` (``create_simulated``, no
pools): the same random operations (insert with a priority, the prompt-boundary split SGLang
makes when a finished request is cached, lookups, lock / unlock, eviction) on both, under each
eviction policy SGLang offers and the tree supports; after every step the sizes agree, and every
eviction frees the same slots in the same order. Both clocks are a shared counter, so recency
ties cannot decide anything."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sglang_sparse.core.logical_tree import LogicalRadixTree

POLICIES = ("lru", "lfu", "slru", "priority")


class FreedSlots:
    """SGLang's allocator as its radix cache sees it: records what eviction frees."""

    device = "cpu"

    def __init__(self) -> None:
        self.freed: list[int] = []

    def free_segment(self, values, start_pos=0):
        self.freed += [int(v) for v in values]

    def free(self, values):
        self.freed += [int(v) for v in values]


class Pair:
    def __init__(self, policy: str, monkeypatch) -> None:
        from sglang.srt.mem_cache import radix_cache
        from sglang.srt.mem_cache.evict_policy import LFUStrategy, LRUStrategy, PriorityStrategy, SLRUStrategy

        clock = itertools.count(1)
        monkeypatch.setattr(radix_cache.time, "monotonic", lambda: float(next(clock)))
        self.alloc = FreedSlots()
        self.sgl = radix_cache.RadixCache.create_simulated(mock_allocator=self.alloc)
        strategy = {"lru": LRUStrategy(), "lfu": LFUStrategy(), "slru": SLRUStrategy(),
                    "priority": PriorityStrategy()}[policy]
        self.sgl.eviction_strategy = strategy
        self.ours = LogicalRadixTree(1, evict_key=strategy.get_priority, clock=lambda: float(next(clock)))
        self.next_slot = itertools.count(100)
        self.locks: list[tuple[object, object]] = []

    def key(self, tokens):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(list(tokens), None)

    def insert(self, tokens, priority, prompt_len):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

        m = self.sgl.match_prefix(MatchPrefixParams(key=self.key(tokens)))
        ours_m = self.ours.match(tokens)
        assert ours_m.length == m.device_prefix_len
        new = [next(self.next_slot) for _ in range(len(tokens) - m.device_prefix_len)]
        value = torch.tensor([int(s) for s in self.ours.path_slots(ours_m.node)[0]] + new, dtype=torch.int64)
        self.sgl.insert(InsertParams(key=self.key(tokens), value=value, priority=priority))
        ins = self.ours.insert(tokens, 0, value, priority=priority)
        assert ins.end == len(tokens)
        if 0 < prompt_len < len(tokens):  # SGLang's split of a finished request at its prompt
            self.sgl.insert(InsertParams(key=self.key(tokens[:prompt_len]), value=value[:prompt_len],
                                         inserted_len=prompt_len, priority=priority + 1))
            self.ours.raise_priority(tokens[:prompt_len], priority + 1)

    def lock(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        node = self.sgl.match_prefix(MatchPrefixParams(key=self.key(tokens))).last_device_node
        mine = self.ours.match(tokens).node
        self.sgl.inc_lock_ref(node)
        self.ours.lock(mine)
        self.locks.append((node, mine))

    def unlock(self, i):
        if self.locks:
            node, mine = self.locks.pop(i % len(self.locks))
            self.sgl.dec_lock_ref(node)
            self.ours.unlock(mine)

    def evict(self, n):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.alloc.freed = []
        self.sgl.evict(EvictParams(num_tokens=n))
        assert self.ours.evict(n).tolist() == self.alloc.freed

    def check(self):
        assert (self.ours.evictable, self.ours.protected) == (self.sgl.evictable_size(), self.sgl.protected_size())
        self.ours.check()


tokens = st.lists(st.integers(1, 3), min_size=1, max_size=8)
op = st.one_of(
    st.tuples(st.just("insert"), tokens, st.integers(0, 2), st.integers(0, 8)),
    st.tuples(st.just("match"), tokens),
    st.tuples(st.just("lock"), tokens),
    st.tuples(st.just("unlock"), st.integers(0, 10)),
    st.tuples(st.just("evict"), st.integers(1, 12)),
)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_tree_evicts_like_sglangs_radix_cache(policy, monkeypatch):
    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(op, max_size=40))
    # a re-inserted leaf counts one more hit (LFU keeps it over a newer leaf hit once)
    @example([("insert", [1, 2], 0, 0), ("insert", [1, 2], 0, 0), ("insert", [3], 0, 0), ("evict", 1)])
    # a lookup that splits a node refreshes both halves
    @example([("insert", [1, 2, 3], 0, 0), ("insert", [2], 0, 0), ("match", [1, 2]), ("evict", 1)])
    def run(ops):
        pair = Pair(policy, monkeypatch)
        for o in ops:
            if o[0] == "insert":
                pair.insert(o[1], o[2], o[3])
            elif o[0] == "match":
                from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

                got = pair.sgl.match_prefix(MatchPrefixParams(key=pair.key(o[1]))).device_prefix_len
                assert pair.ours.match(o[1]).length == got
            elif o[0] == "lock":
                pair.lock(o[1])
            elif o[0] == "unlock":
                pair.unlock(o[1])
            else:
                pair.evict(o[1])
            pair.check()

    run()
