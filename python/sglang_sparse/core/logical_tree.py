"""Logical radix tree: prefixes are matched on logical tokens, values are the KV slots retained.

A node covers the logical positions ``[start, start + len(key))`` of every sequence through it
(``start`` = summed key lengths of its ancestors). Its value is sparse once pruned:

```
 node.key      t0  t1  t2  t3  t4  t5  t6  t7        logical tokens (the match key, never shrinks)
 offsets        0   1   2   3   4   5   6   7        offset within the node
 node.kept     [0,          3,  4,          7]       offsets that still have KV (None = all)
 node.slots    [s0,        s3, s4,         s7]       one KV slot per kept offset
```

A match of N logical tokens returns the P <= N retained slots of its path and their logical
positions; a request on that path holds the P slots in rows ``[0, P)`` and its own tokens
after them (positions stay logical, see ``srt/step_hooks.py``). Capacity accounting, lock
references and eviction count retained slots, not key lengths.

A method that stores KV outside the engine's pool (KIVI's quantized blocks) caches *units*
instead: a unit node has no slots (``kept`` empty) and ``units[j]`` stands for logical offsets
``[j * U, (j + 1) * U)`` of its key (U = the method's unit, the tree's page is a multiple of it, so
splits never cut a unit). Units are counted apart from slots (``evictable_units`` /
``protected_units``), evicted apart (``evict_units``; slot eviction skips unit nodes), and the tree
holds one reference per unit it keeps (taken and dropped by the caller, ``srt/cache/radix.py``).

Locks follow SGLang's convention: locking a node increments ``lock_ref`` on it and on every
ancestor, so ``lock_ref > 0`` means "some request reads through here" and such a node is
neither evicted nor pruned. Engine-agnostic (torch only); ``srt/radix.py`` adapts it to
SGLang's prefix-cache interface.
"""

from __future__ import annotations

import heapq
import itertools
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)

# SGLang eviction policies whose strategy reads node fields this tree does not keep.
UNSUPPORTED_EVICTION_POLICIES = types.MappingProxyType(
    {"tlru": "it needs per-branch history lengths (T-LRU) that the logical tree does not keep"})


class PruneBlocked(Exception):
    """A node in the interval is in use (locked by a running request)."""


@dataclass(eq=False)
class Node:
    key: tuple = ()
    slots: torch.Tensor = field(default_factory=lambda: _EMPTY)
    kept: torch.Tensor | None = None  # sorted offsets within key with a slot; None = all
    parent: "Node | None" = None
    children: dict = field(default_factory=dict)  # first page of child key -> child
    lock_ref: int = 0
    last_use: float = 0  # the tree's clock at the last lookup or insert through this node
    priority: int = 0  # max over the requests that inserted through it (and /prefix/priority)
    hit_count: int = 0  # inserts that added to it or through it (SGLang's rule, for LFU/SLRU)
    records: list = field(default_factory=list)  # pruning records covering this node
    namespace: Any = None  # roots only: the extra_key they are stored under
    units: torch.Tensor = field(default_factory=lambda: _EMPTY)  # method units, one per U logical tokens

    @property
    def n_units(self) -> int:
        return int(self.units.numel())

    @property
    def retained(self) -> int:
        return int(self.slots.numel())

    @property
    def last_access_time(self) -> float:
        """``last_use`` under SGLang's name (its eviction strategies read it)."""
        return self.last_use

    @property
    def pruned(self) -> bool:
        return self.kept is not None

    def offsets(self) -> torch.Tensor:
        return torch.arange(len(self.key), dtype=torch.int64) if self.kept is None else self.kept


class Match(NamedTuple):
    length: int  # N: logical tokens matched
    node: Node  # last node of the matched path (the root when N == 0)
    slots: torch.Tensor  # P retained slots of the path, in logical order
    positions: torch.Tensor  # their logical positions (ascending)


class Inserted(NamedTuple):
    end: int  # the tree now covers logical [0, end) of the sequence through ``node``
    node: Node
    row_slots: torch.Tensor  # slots for logical [start, end) as the tree holds them
    duplicates: torch.Tensor  # caller's slots in [start, end) the tree already had: free them


def _priority_then_lru(node: Node):
    return (node.priority, node.last_use)


class LogicalRadixTree:
    """``evict_key(node)``: eviction order of unlocked leaves, smallest first (default: priority,
    then least recently used; the SGLang adapter passes the strategy of SGLang's
    ``--radix-eviction-policy``). ``clock()``: increasing timestamps for recency."""

    def __init__(self, page_size: int = 1, evict_key: Callable[[Node], Any] | None = None,
                 clock: Callable[[], float] | None = None, unit: int = 0) -> None:
        assert not unit or page_size % unit == 0, "the page must hold whole units"
        self.page = page_size
        self.unit = unit  # logical tokens per method unit (0: the tree caches slots only)
        self.roots: dict[Any, Node] = {}
        self.evictable = 0  # retained slots in unlocked nodes
        self.protected = 0  # retained slots in locked nodes
        self.evictable_units = 0  # method units in unlocked nodes
        self.protected_units = 0  # method units in locked nodes
        self.evict_key = evict_key or _priority_then_lru
        self._clock = clock or itertools.count(1).__next__

    # ---- structure -------------------------------------------------------------------------
    def root(self, extra_key: Any = None, create: bool = True) -> Node:
        """The root of a namespace. Roots exist only while something is cached under them
        (``_remove_leaf`` drops an emptied one); ``create=False`` gives a lookup of a namespace
        with nothing cached an unstored empty root, so client-chosen keys cannot grow the tree."""
        node = self.roots.get(extra_key)
        if node is None:
            node = Node(lock_ref=1, namespace=extra_key)  # a root is never evicted
            if create:
                self.roots[extra_key] = node
        return node

    def is_root(self, node: Node) -> bool:
        return node.parent is None

    def _first(self, key: Sequence[int]) -> tuple:
        return tuple(key[: self.page])

    def _aligned(self, n: int) -> int:
        return n - n % self.page

    def _common(self, a: Sequence[int], b: Sequence[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return self._aligned(n)

    def path(self, node: Node) -> list[Node]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def path_slots(self, node: Node) -> tuple[torch.Tensor, torch.Tensor]:
        """(retained slots, their logical positions) from the root to ``node``."""
        slots, positions, start = [], [], 0
        for n in self.path(node):
            slots.append(n.slots)
            positions.append(n.offsets() + start)
            start += len(n.key)
        if not slots:
            return _EMPTY, _EMPTY
        return torch.cat(slots), torch.cat(positions)

    def _split(self, child: Node, at: int, now: float | None = None) -> Node:
        """Cut ``child`` at key offset ``at`` (page aligned); return the new upper half. A lookup
        or insert that splits (``now``) refreshes both halves, as SGLang's tree does."""
        if now is not None:
            child.last_use = now
        upper = Node(key=child.key[:at], parent=child.parent, lock_ref=child.lock_ref,
                     last_use=child.last_use, priority=child.priority, hit_count=child.hit_count,
                     records=list(child.records))
        if child.n_units:  # at is page aligned, so it falls between units
            cut = at // self.unit
            upper.units, child.units = child.units[:cut], child.units[cut:]
        if child.kept is None:
            upper.slots, child.slots = child.slots[:at], child.slots[at:]
        else:
            low = child.kept < at
            upper.kept, upper.slots = child.kept[low], child.slots[low]
            child.kept, child.slots = child.kept[~low] - at, child.slots[~low]
        child.key = child.key[at:]
        child.parent.children[self._first(upper.key)] = upper
        upper.children = {self._first(child.key): child}
        child.parent = upper
        return upper

    # ---- match / insert --------------------------------------------------------------------
    def _descend(self, node: Node, tokens: Sequence[int], now: float):
        """Walk the cached path of ``tokens`` below ``node``: yields ``(child, at, n)``, the next
        node on it covering ``tokens[at: at + n]`` (split first when the path ends inside it).
        Stops where the tree and ``tokens`` part; a caller may stop earlier (break)."""
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._first(tokens[pos:]))
            if child is None:
                return
            n = self._common(child.key, tokens[pos:])
            if n == 0:
                return
            if n < len(child.key):
                child = self._split(child, n, now)
            yield child, pos, n
            node, pos = child, pos + n

    def _attach(self, parent: Node, new: Node, extra_key: Any) -> None:
        parent.children[self._first(new.key)] = new
        if parent.parent is None:  # the namespace's first entry: its root is stored from now on
            self.roots.setdefault(extra_key, parent)

    def match(self, tokens: Sequence[int], extra_key: Any = None) -> Match:
        """Longest page-aligned logical prefix of ``tokens`` in the tree (splits the last node
        when the match ends inside it, so the returned node ends exactly at N)."""
        node, pos, now = self.root(extra_key, create=False), 0, self._clock()
        node.last_use = now
        for child, at, n in self._descend(node, tokens[: self._aligned(len(tokens))], now):
            child.last_use = now
            node, pos = child, at + n
        slots, positions = self.path_slots(node)
        return Match(pos, node, slots, positions)

    def insert(self, tokens: Sequence[int], start: int, slots: torch.Tensor,
               extra_key: Any = None, priority: int = 0, inserted_len: int = 0) -> Inserted:
        """Add logical ``tokens[start:]`` (slots given for exactly those positions) below the
        path of ``tokens[:start]``, which must already be in the tree (the caller matched and
        locked it). Positions the tree already has are returned as duplicates. Insertion stops
        at a pruned node past ``start``: its KV differs from the caller's, so the caller keeps
        its own slots from there (``end`` says where).

        As in SGLang's tree: the path's priority becomes at least ``priority``, and a node's
        ``hit_count`` grows when this insert reaches past ``inserted_len`` (what the caller
        inserted before) through it."""
        L = self._aligned(len(tokens))
        assert 0 <= start <= L and slots.numel() >= L - start, (start, L, slots.numel())
        node, pos, now = self.root(extra_key, create=False), 0, self._clock()
        row, dups = [], []
        for child, at, n in self._descend(node, tokens[:L], now):
            if at + n > start:
                if child.pruned:
                    if at < start:  # the caller's own part begins inside this node
                        child = self._split(child, start - at, now)
                        child.last_use, node, pos = now, child, start
                    break
                lo = max(at, start)
                row.append(child.slots[lo - at:])
                dups.append(slots[lo - start: at + n - start])
            child.last_use = now
            child.priority = max(child.priority, priority)
            if at + n > inserted_len:
                child.hit_count += 1
            node, pos = child, at + n
        assert pos >= start, f"prefix [0, {start}) is not in the tree (reached {pos})"
        if pos < L and not (node.children.get(self._first(tokens[pos:L])) is not None):
            new = Node(key=tuple(tokens[pos:L]), slots=slots[pos - start: L - start].clone(),
                       parent=node, last_use=now, priority=priority, hit_count=int(L > inserted_len))
            self._attach(node, new, extra_key)
            self.evictable += new.retained
            row.append(new.slots)
            node, pos = new, L
        cat = lambda xs: torch.cat(xs) if xs else _EMPTY  # noqa: E731
        return Inserted(pos, node, cat(row), cat(dups))

    def raise_priority(self, tokens: Sequence[int], priority: int, extra_key: Any = None) -> None:
        """The cached path of ``tokens`` (split where it ends) gets at least ``priority``: how
        SGLang caches a finished request, its prompt one above its output, so that eviction drops
        the output before the prompt."""
        m = self.match(tokens, extra_key)
        for n in self.path(m.node):
            n.priority = max(n.priority, priority)

    def insert_units(self, tokens: Sequence[int], units: torch.Tensor, extra_key: Any = None,
                     priority: int = 0) -> torch.Tensor:
        """Cache a finished request's method units: ``units[j]`` holds logical
        ``[j * U, (j + 1) * U)`` of ``tokens`` (``len(tokens) == len(units) * U``, cut to the
        page). Positions the tree already has keep the tree's units (the request's copies stay
        the request's); returns the units the tree took, for the caller to reference."""
        L = self._aligned(min(len(tokens), units.numel() * self.unit))
        node, pos, now = self.root(extra_key, create=False), 0, self._clock()
        for child, at, n in self._descend(node, tokens[:L], now):
            child.last_use, child.priority = now, max(child.priority, priority)
            node, pos = child, at + n
        if pos >= L:
            return _EMPTY
        taken = units[pos // self.unit: L // self.unit].clone()
        new = Node(key=tuple(tokens[pos:L]), kept=_EMPTY, parent=node, last_use=now, priority=priority,
                   units=taken)
        self._attach(node, new, extra_key)
        self.evictable_units += new.n_units
        return taken

    def path_units(self, node: Node) -> torch.Tensor:
        """The units from the root to ``node``, in logical order (a unit path has no gaps)."""
        parts = [n.units for n in self.path(node)]
        return torch.cat(parts) if parts else _EMPTY

    # ---- locks, eviction ---------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self.evictable -= node.retained
                self.protected += node.retained
                self.evictable_units -= node.n_units
                self.protected_units += node.n_units
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node.parent is not None:
            assert node.lock_ref > 0, "unlock without lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable += node.retained
                self.protected -= node.retained
                self.evictable_units += node.n_units
                self.protected_units -= node.n_units
            node = node.parent

    def _remove_leaf(self, node: Node) -> torch.Tensor:
        parent = node.parent
        del parent.children[self._first(node.key)]
        if parent.parent is None and not parent.children and self.roots.get(parent.namespace) is parent:
            del self.roots[parent.namespace]
        self.evictable -= node.retained
        self.evictable_units -= node.n_units
        freed, node.slots = node.slots, _EMPTY
        return freed

    def _evict_leaves(self, wanted: int, units: bool) -> torch.Tensor:
        """Remove unlocked leaves of one kind (slot nodes, or unit nodes) in ``evict_key`` order
        until ``wanted`` slots (units) went; returns them in the order freed."""
        def candidate(n: Node) -> bool:
            return not n.children and n.lock_ref == 0 and bool(n.n_units) == units

        heap = [(self.evict_key(n), id(n), n) for n in self.nodes() if candidate(n)]
        heapq.heapify(heap)
        freed, count = [], 0
        while heap and count < wanted:
            _, _, n = heapq.heappop(heap)
            parent = n.parent
            out = n.units if units else None
            slots = self._remove_leaf(n)
            freed.append(out if units else slots)
            count += freed[-1].numel()
            if parent.parent is not None and candidate(parent):
                heapq.heappush(heap, (self.evict_key(parent), id(parent), parent))
        return torch.cat(freed) if freed else _EMPTY

    def evict(self, num_slots: int) -> torch.Tensor:
        """Free at least ``num_slots`` retained slots from unlocked leaves in ``evict_key`` order
        (or everything evictable); returns the freed slots in the order they were freed. Unit
        nodes hold no slots and are left alone (``evict_units``)."""
        return self._evict_leaves(num_slots, units=False)

    def evict_units(self, num_units: int) -> torch.Tensor:
        """Remove unlocked unit leaves in ``evict_key`` order until at least ``num_units`` units
        went (or all evictable); returns the units for the caller to dereference."""
        return self._evict_leaves(num_units, units=True)

    def all_units(self) -> torch.Tensor:
        parts = [n.units for n in self.nodes() if n.n_units]
        return torch.cat(parts) if parts else _EMPTY

    def delete_subtree(self, node: Node) -> torch.Tensor:
        """Remove ``node`` and everything below it (all unlocked); returns the freed slots."""
        if node.parent is None or node.lock_ref > 0:
            raise PruneBlocked("the subtree is in use by a running request")
        assert not any(n.n_units for n in self._walk(node)), "unit nodes are evicted with evict_units"
        freed = []
        for n in reversed(list(self._walk(node))):
            freed.append(self._remove_leaf(n))
        return torch.cat(freed) if freed else _EMPTY

    # ---- pruning -----------------------------------------------------------------------------
    def interval_nodes(self, tokens: Sequence[int], left: int, right: int,
                       extra_key: Any = None) -> list[tuple[int, Node]]:
        """Nodes covering logical ``[left, right)`` of ``tokens`` as (start, node), split so the
        interval starts and ends on node boundaries. Raises KeyError if ``tokens[:right]`` is not
        all cached, PruneBlocked if any of them is locked."""
        m = self.match(tokens[:right], extra_key)
        if m.length < right:
            raise KeyError(f"only {m.length} of the first {right} tokens are cached")
        out, start = [], 0
        for n in self.path(m.node):
            end = start + len(n.key)
            if end > left:
                if start < left:
                    self._split(n, left - start)
                    return self.interval_nodes(tokens, left, right, extra_key)
                out.append((start, n))
            start = end
        if any(n.lock_ref > 0 for _, n in out):
            raise PruneBlocked("a request is reading this prefix")
        return out

    def retained_in(self, nodes: list[tuple[int, Node]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(logical positions, slots) still retained in ``nodes``."""
        if not nodes:
            return _EMPTY, _EMPTY
        return (torch.cat([n.offsets() + s for s, n in nodes]), torch.cat([n.slots for _, n in nodes]))

    def apply_keep(self, nodes: list[tuple[int, Node]], keep: torch.Tensor, record: dict) -> torch.Tensor:
        """Keep only the retained entries where ``keep`` (bool, over ``retained_in(nodes)``) is
        True; returns the dropped slots for the caller to free."""
        if any(n.lock_ref > 0 for _, n in nodes):
            raise PruneBlocked("a request is reading this prefix")
        assert keep.numel() == sum(n.retained for _, n in nodes), "keep mask does not match the retained entries"
        dropped, i = [], 0
        for _, n in nodes:
            k = keep[i: i + n.retained]
            i += n.retained
            dropped.append(n.slots[~k])
            n.kept, n.slots = n.offsets()[k], n.slots[k]
            self.evictable -= int(dropped[-1].numel())
            n.records.append(dict(record))
        return torch.cat(dropped) if dropped else _EMPTY

    # ---- inspection ------------------------------------------------------------------------
    def _walk(self, node: Node) -> Iterator[Node]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def nodes(self) -> Iterator[Node]:
        for r in self.roots.values():
            for n in self._walk(r):
                if n.parent is not None:
                    yield n

    def total_retained(self) -> int:
        return sum(n.retained for n in self.nodes())

    def check(self) -> torch.Tensor:
        """Verify the tree's invariants; return all slots it owns (each exactly once)."""
        evictable = protected = evictable_units = protected_units = 0
        owned, units = [], []
        for n in self.nodes():
            assert len(n.key) > 0 and len(n.key) % self.page == 0, "key not page aligned"
            if n.n_units:
                assert n.n_units * self.unit == len(n.key) and n.retained == 0, "a unit node must be all units"
                units.append(n.units)
                if n.lock_ref:
                    protected_units += n.n_units
                else:
                    evictable_units += n.n_units
            assert n.parent.children.get(self._first(n.key)) is n, "child indexed under a wrong key"
            if n.kept is None:
                assert n.retained == len(n.key), "unpruned node without one slot per token"
            else:
                assert n.kept.numel() == n.retained, "kept offsets and slots differ in length"
                if n.retained:
                    assert bool((n.kept[1:] > n.kept[:-1]).all()), "kept offsets not increasing"
                    assert 0 <= int(n.kept[0]) and int(n.kept[-1]) < len(n.key), "kept offset out of range"
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), "lock below exceeds lock above"
            if n.lock_ref:
                protected += n.retained
            else:
                evictable += n.retained
            owned.append(n.slots)
        assert (evictable, protected) == (self.evictable, self.protected), (
            f"size accounting drifted: counted {evictable}/{protected}, "
            f"tracked {self.evictable}/{self.protected}")
        assert (evictable_units, protected_units) == (self.evictable_units, self.protected_units), (
            f"unit accounting drifted: counted {evictable_units}/{protected_units}, "
            f"tracked {self.evictable_units}/{self.protected_units}")
        if units:
            u = torch.cat(units)
            assert u.unique().numel() == u.numel(), "a unit is held by two tree nodes"
        slots = torch.cat(owned) if owned else _EMPTY
        assert slots.unique().numel() == slots.numel(), "a slot is owned by two tree nodes"
        return slots

    def describe(self, node: Node) -> dict:
        return {"logical_tokens": len(node.key), "retained_tokens": node.retained,
                "locked": node.lock_ref > 0, "priority": node.priority,
                "pruning_records": list(node.records)}
