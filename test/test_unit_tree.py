"""Method units in the logical radix tree (KIVI's blocks, ``LogicalRadixTree(unit=U)``): unit
cases, and a hypothesis state machine that runs requests (match + lock, write own units, finish
= insert + drop their references, abort) and evictions against a refcounted toy store, checking
after every step that each unit's holder count equals the tree's hold plus the requests' holds."""

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_sparse.core.logical_tree import LogicalRadixTree
from sglang_sparse.core.quant_store import QuantizedBlockStore

U = 4
T = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


def test_units_match_split_lock_and_evict_apart_from_slots():
    tree = LogicalRadixTree(page_size=U, unit=U)
    taken = tree.insert_units(list(range(12)), T(7, 8, 9))
    assert taken.tolist() == [7, 8, 9] and tree.evictable_units == 3 and tree.evictable == 0
    m = tree.match(list(range(8)) + [99, 98, 97, 96, 95])
    assert m.length == 8 and m.slots.numel() == 0  # whole units only, and no slots
    assert tree.path_units(m.node).tolist() == [7, 8]  # the split divides the units at the cut
    tree.lock(m.node)
    assert (tree.evictable_units, tree.protected_units) == (1, 2)
    assert tree.evict(100).numel() == 0  # slot eviction leaves unit nodes alone
    assert tree.evict_units(100).tolist() == [9]  # the unlocked leaf goes, the locked path stays
    # a second request's copy of the same tokens: the tree keeps its own units, takes only new ones
    assert tree.insert_units(list(range(8)) + [5, 5, 5, 5], T(1, 2, 3)).tolist() == [3]
    tree.unlock(m.node)
    tree.check()
    assert sorted(tree.evict_units(100).tolist()) == [3, 7, 8]
    assert not tree.roots  # an emptied namespace leaves no root
    tree.check()


def test_a_partial_unit_is_not_cached():
    tree = LogicalRadixTree(page_size=U, unit=U)
    assert tree.insert_units(list(range(10)), T(1, 2)).tolist() == [1, 2]  # 10 tokens: 2 whole units
    assert tree.match(list(range(10))).length == 8
    tree.check()


def test_store_refcounts_and_reclaim():
    store = QuantizedBlockStore(1, 1, 32, 4, 4, 32)
    a = store.alloc(3)
    store.ref(a[:2])
    store.free(a)
    assert store.free_count() == 2 and [store.holders(b) for b in a] == [1, 1, 0]
    cached = list(a[:2])
    store.reclaim = lambda n: bool(cached) and (store.free([cached.pop()]) or True)
    assert store.alloc(4) is not None and not cached  # the store asked for the cached blocks
    try:
        store.free([a[2], a[2]])
        raise AssertionError("a double free must raise")
    except RuntimeError:
        pass


class UnitMachine(RuleBasedStateMachine):
    """Tokens from a tiny alphabet so prefixes collide; requests hold a reference to each unit of
    their match and of what they wrote; finishing inserts and lets go."""

    def __init__(self):
        super().__init__()
        self.tree = LogicalRadixTree(page_size=U, unit=U)
        self.store = QuantizedBlockStore(1, 1, 32, 64, 2, 32)
        self.store.reclaim = self._reclaim
        self.running = {}  # id -> (tokens, units held, matched node)
        self.ids = 0

    def _reclaim(self, n):
        gone = self.tree.evict_units(n)
        if gone.numel():
            self.store.free(gone.tolist())
        return bool(gone.numel())

    @rule(data=st.data(), body=st.lists(st.integers(1, 2), min_size=U, max_size=6 * U))
    def start(self, data, body):
        m = self.tree.match(body)
        self.tree.lock(m.node)
        units = self.tree.path_units(m.node).tolist()
        self.store.ref(units)
        own = self.store.alloc((len(body) - m.length) // U)
        if own is None:  # the store is full even after evicting the cache: the request cannot run
            self.store.free(units)
            self.tree.unlock(m.node)
            return
        self.ids += 1
        self.running[self.ids] = (body, units + own, m.node)

    @rule(data=st.data(), insert=st.booleans())
    def finish(self, data, insert):
        if not self.running:
            return
        rid = data.draw(st.sampled_from(sorted(self.running)))
        tokens, units, node = self.running.pop(rid)
        if insert:  # a finished request; an aborted one just lets go
            taken = self.tree.insert_units(tokens, torch.tensor(units, dtype=torch.int64))
            self.store.ref(taken.tolist())
        self.store.free(units)
        self.tree.unlock(node)

    @rule(n=st.integers(1, 10))
    def evict(self, n):
        self._reclaim(n)

    @invariant()
    def every_unit_has_its_holders(self):
        self.tree.check()
        holders = [0] * self.store.num_blocks
        for u in self.tree.all_units().tolist():
            holders[u] += 1
        for _, units, _ in self.running.values():
            for u in units:
                holders[u] += 1
        assert holders == [self.store.holders(b) for b in range(self.store.num_blocks)]
        assert self.store.free_count() == holders.count(0)


TestUnitMachine = UnitMachine.TestCase
TestUnitMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
