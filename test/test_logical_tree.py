"""The logical radix tree (core/logical_tree.py): unit cases and a hypothesis state machine that
drives insert / match / prune (compact) / evict / chain park-resume / abort against a toy
allocator and checks after every step that each slot has exactly one owner."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_sparse.core.chain_index import ChainCacheIndex, ChainStatus
from sglang_sparse.core.logical_tree import LogicalRadixTree, PruneBlocked

T = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731


def test_match_splits_and_returns_logical_length():
    tree = LogicalRadixTree()
    tree.insert([1, 2, 3, 4], 0, T(10, 11, 12, 13))
    m = tree.match([1, 2, 9])
    assert m.length == 2 and m.slots.tolist() == [10, 11] and m.positions.tolist() == [0, 1]
    assert tree.check().sort().values.tolist() == [10, 11, 12, 13]
    assert tree.evictable == 4 and tree.protected == 0


def test_pruned_path_matches_full_length_with_fewer_slots():
    tree = LogicalRadixTree()
    tree.insert(list(range(8)), 0, torch.arange(100, 108))
    nodes = tree.interval_nodes(list(range(8)), 2, 6)
    pos, slots = tree.retained_in(nodes)
    assert pos.tolist() == [2, 3, 4, 5]
    dropped = tree.apply_keep(nodes, T(1, 0, 0, 1).bool(), {"policy": "test"})
    assert dropped.tolist() == [103, 104]
    m = tree.match(list(range(8)) + [99])
    assert m.length == 8
    assert m.positions.tolist() == [0, 1, 2, 5, 6, 7]
    assert m.slots.tolist() == [100, 101, 102, 105, 106, 107]
    assert tree.evictable == 6
    tree.check()


def test_insert_stops_at_pruned_node_and_reports_duplicates():
    tree = LogicalRadixTree()
    tree.insert([1, 2, 3, 4, 5, 6], 0, torch.arange(10, 16))
    # a second copy of [1, 2] plus new tokens: [1, 2] duplicates, [7] is new
    ins = tree.insert([1, 2, 7], 0, T(20, 21, 22))
    assert ins.end == 3 and ins.duplicates.tolist() == [20, 21] and ins.row_slots.tolist() == [10, 11, 22]
    tree.apply_keep(tree.interval_nodes([1, 2, 3, 4, 5, 6], 2, 4), T(0, 1).bool(), {})
    m = tree.match([1, 2])
    tree.lock(m.node)
    # the caller computed [3, 4, 5, 6, 8] itself: the pruned [3, 4] has other KV, so stop there
    ins = tree.insert([1, 2, 3, 4, 5, 6, 8], 2, T(30, 31, 32, 33, 34))
    assert ins.end == 2 and ins.duplicates.numel() == 0
    tree.unlock(m.node)
    tree.check()


def test_locked_prefix_blocks_pruning_and_eviction():
    tree = LogicalRadixTree()
    tree.insert([1, 2, 3, 4], 0, torch.arange(4))
    m = tree.match([1, 2, 3, 4])
    tree.lock(m.node)
    with pytest.raises(PruneBlocked):
        tree.interval_nodes([1, 2, 3, 4], 0, 2)
    assert tree.evict(10).numel() == 0 and tree.protected == 4
    tree.unlock(m.node)
    assert tree.evict(10).numel() == 4 and tree.total_retained() == 0
    tree.check()


def test_page_alignment():
    tree = LogicalRadixTree(page_size=4)
    tree.insert(list(range(10)), 0, torch.arange(10))  # only the first 8 tokens are cached
    assert tree.match(list(range(10))).length == 8
    assert tree.match([0, 1, 2, 3, 4, 5, 9, 9]).length == 4
    tree.check()


def test_extra_keys_are_separate_namespaces():
    tree = LogicalRadixTree()
    tree.insert([1, 2], 0, T(1, 2), extra_key="lora-a")
    assert tree.match([1, 2], extra_key=None).length == 0
    assert tree.match([1, 2], extra_key="lora-a").length == 2


class TreeMachine(RuleBasedStateMachine):
    """Toy engine: slots 1..S, requests hold a lock on their matched node plus their own slots
    for logical [N, len); chains park a finished request's slots and lock outside the tree."""

    PAGE = 1
    S = 48

    def __init__(self):
        super().__init__()
        self.tree = LogicalRadixTree(self.PAGE)
        self.free = set(range(1, self.S + 1))
        self.running = {}  # id -> dict(tokens, N, node, own)
        self.cached = []  # sequences inserted at some point (targets for prune)
        self.chains = ChainCacheIndex(self._release_chain)
        self.ids = 0
        self.content = {}  # slot -> the token prefix whose last position it holds the KV of

    # -- helpers ---------------------------------------------------------------------------
    def _release_chain(self, payload):
        self.free.update(payload["own"].tolist())
        self.tree.unlock(payload["node"])

    def _alloc(self, n):
        if len(self.free) < n:
            self.free.update(self.tree.evict(n - len(self.free)).tolist())
        if len(self.free) < n:
            return None
        taken = sorted(self.free)[:n]
        self.free.difference_update(taken)
        for slot in taken:
            self.content.pop(slot, None)
        return torch.tensor(taken, dtype=torch.int64)

    def _start(self, tokens, node, n, own):
        for i, slot in enumerate(own.tolist()):
            self.content.setdefault(slot, tuple(tokens[: n + i + 1]))
        self.ids += 1
        self.running[self.ids] = dict(tokens=tokens, N=n, node=node, own=own, chain=None)
        return self.ids

    # -- rules -------------------------------------------------------------------------------
    @rule(data=st.data(), body=st.lists(st.integers(1, 3), min_size=1, max_size=8))
    def new_request(self, data, body):
        tokens = [t for t in body for _ in range(self.PAGE)]  # page-aligned length
        if self.cached and data.draw(st.booleans()):  # share a prefix with a cached sequence
            base = data.draw(st.sampled_from(self.cached))
            tokens = base[: data.draw(st.integers(0, len(base) // self.PAGE)) * self.PAGE] + tokens
        m = self.tree.match(tokens)
        self.tree.lock(m.node)
        own = self._alloc(len(tokens) - m.length)
        if own is None:
            self.tree.unlock(m.node)
            return
        self._start(tokens, m.node, m.length, own)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), final=st.booleans())
    def checkpoint(self, data, final):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running[rid]
        ins = self.tree.insert(r["tokens"], r["N"], r["own"])
        assert ins.row_slots.numel() == ins.end - r["N"]
        self.free.update(ins.duplicates.tolist())
        self.cached.append(r["tokens"])
        rest = r["own"][ins.end - r["N"]:]  # positions past a pruned node stay the request's
        if final:
            self.free.update(rest.tolist())
            self.tree.unlock(r["node"])
            del self.running[rid]
        else:  # chunked prefill: the lock moves to the node the insert ended on
            self.tree.lock(ins.node)
            self.tree.unlock(r["node"])
            r.update(N=ins.end, node=ins.node, own=rest)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running.pop(rid)
        self.free.update(r["own"].tolist())
        self.tree.unlock(r["node"])
        if r["chain"]:
            self.chains.invalidate(r["chain"], "aborted")

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def park(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        r = self.running.pop(rid)
        chain = r["chain"] or self.chains.start("fp").chain_id
        self.chains.park(chain, r["tokens"], {"own": r["own"], "node": r["node"], "N": r["N"]},
                         rows=r["own"].numel())

    @precondition(lambda self: any(c.status is ChainStatus.IDLE for c in self.chains.chains.values()))
    @rule(data=st.data(), extra=st.lists(st.integers(1, 3), min_size=1, max_size=3))
    def resume(self, data, extra):
        chain = data.draw(st.sampled_from(sorted(
            c.chain_id for c in self.chains.chains.values() if c.status is ChainStatus.IDLE)))
        rec = self.chains.get(chain)
        tokens = list(rec.tokens) + [t for t in extra for _ in range(self.PAGE)]
        more = self._alloc(len(tokens) - len(rec.tokens))
        if more is None or rec.status is not ChainStatus.IDLE:  # allocation may reclaim nothing here
            if more is not None:
                self.free.update(more.tolist())
            return
        self.chains.resume(chain, "fp", tokens)
        p, rec.payload, rec.rows = rec.payload, None, 0  # lent: the request owns it now
        rid = self._start(tokens, p["node"], p["N"], torch.cat([p["own"], more]))
        self.running[rid]["chain"] = chain

    @rule(rows=st.integers(0, 20))
    def reclaim(self, rows):
        self.chains.reclaim(rows)

    @rule(n=st.integers(1, 20))
    def evict(self, n):
        self.free.update(self.tree.evict(n).tolist())

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def prune(self, data):
        tokens = data.draw(st.sampled_from(self.cached))
        pages = len(tokens) // self.PAGE
        a, b = sorted(data.draw(st.lists(st.integers(0, pages), min_size=2, max_size=2)))
        left, right = a * self.PAGE, b * self.PAGE
        try:
            nodes = self.tree.interval_nodes(tokens, left, right)
        except (KeyError, PruneBlocked):
            return
        pos, slots = self.tree.retained_in(nodes)
        keep = torch.tensor(data.draw(st.lists(st.booleans(), min_size=pos.numel(), max_size=pos.numel())),
                            dtype=torch.bool)
        dropped = self.tree.apply_keep(nodes, keep, {"interval": [left, right]})
        assert dropped.numel() == int((~keep).sum())
        self.free.update(dropped.tolist())
        assert self.tree.match(tokens[:right]).length == right  # the logical path still matches

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def every_slot_has_one_owner(self):
        owners = [self.tree.check().tolist(), list(self.free)]
        owners += [r["own"].tolist() for r in self.running.values()]
        owners += [c.payload["own"].tolist() for c in self.chains.chains.values() if c.payload is not None]
        flat = [s for o in owners for s in o]
        assert len(flat) == len(set(flat)), "a slot has two owners"
        assert set(flat) == set(range(1, self.S + 1)), "a slot leaked"

    @invariant()
    def matches_return_the_right_positions(self):
        for tokens in self.cached:
            m = self.tree.match(tokens)
            assert m.slots.numel() == m.positions.numel() <= m.length
            for slot, pos in zip(m.slots.tolist(), m.positions.tolist()):
                assert self.content[slot] == tuple(tokens[: pos + 1]), "slot holds another position"

    @invariant()
    def running_paths_are_attached(self):
        for r in self.running.values():
            node = r["node"]
            if node.parent is None:
                continue  # matched nothing: an empty root, stored only once something is cached under it
            while node.parent is not None:
                assert node.lock_ref > 0
                node = node.parent
            assert node in self.tree.roots.values()

    @invariant()
    def no_empty_root_is_kept(self):
        assert all(r.children for r in self.tree.roots.values())


class PagedTreeMachine(TreeMachine):
    PAGE = 2


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedTreeMachine = PagedTreeMachine.TestCase
TestPagedTreeMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_lookups_under_new_namespaces_leave_no_roots():
    """Client-chosen extra_key / cache_salt values must not grow the tree: a miss stores nothing,
    and evicting a namespace's last entry drops its root."""
    tree = LogicalRadixTree(page_size=1)
    for salt in range(10_000):
        assert tree.match([1, 2, 3], ("k", salt)).length == 0
    assert tree.roots == {}
    ins = tree.insert([5, 6, 7], 0, torch.tensor([10, 11, 12]), ("k", "a"))
    assert ins.end == 3 and list(tree.roots) == [("k", "a")]
    assert tree.match([5, 6], ("k", "a")).length == 2
    assert sorted(tree.evict(100).tolist()) == [10, 11, 12]
    assert tree.roots == {}
    tree.check()
