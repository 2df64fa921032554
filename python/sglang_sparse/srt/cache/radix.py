"""``SparseRadixCache``: SGLang's prefix cache with logical keys over retained slots.

Registered as radix-cache backend ``sglang_sparse`` (SGLang's ``register_radix_cache_backend``);
the launcher selects it with ``--radix-cache-backend sglang_sparse``. It subclasses SGLang's
``UnifiedRadixCache`` only as a shell: the shell is built *disabled* (so none of its own tree,
HiCache or storage paths is set up; ``disable`` is then set to say whether *our* tree is on,
which is what SGLang reads it for), and the prefix tree is ``core.logical_tree.LogicalRadixTree``:

- keys are logical tokens (plus SGLang's ``extra_key`` / ``cache_salt`` namespace);
- values are the KV slots still retained (all of them until ``/prune`` drops some);
- ``evictable_size`` / ``protected_size`` count retained slots; eviction frees them to SGLang's
  allocator; ``check_integrity`` (``cache/integrity.py``) proves every slot has one owner.

Rows vs logical positions of a request on a pruned path (P retained slots for N logical tokens):
``match_prefix`` reports N (SGLang prefills only ``[N, len)``) and ``cache_protected_len = P``;
``prefix_device_indices`` pads the P slots to N; after allocation ``engine/rows.py``
moves the suffix slots from row N to row P and records the gap N - P as the request's RoPE
offset (``req.sparse``). With nothing pruned P == N and all of this is SGLang's own path.

A method with a store of its own (KIVI) keeps its payload in the tree instead of slots
(``units_on``, the launcher's ``unit_cache``): SGLang's slot insertion stays off (the method
evicts rows), ``match_prefix`` matches whole units (the tree's page is the unit) and starts the
request on them with no rows (P = 0: ``sparse(req).units``, handed to the method when the
request starts, ``engine/steps.py``), ``cache_units`` keeps a finishing request's units, and the
method's store calls ``reclaim_units`` when it runs short. The tree holds one reference per unit.

Chain Cache rides the same class: ``match_prefix`` first lends a resumed chain's rows,
``claim_kv_row`` parks a finishing chain's rows, ``session_records`` reports parked rows.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchResult,
    TreeLock,
)
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

from sglang_sparse.core.logical_tree import UNSUPPORTED_EVICTION_POLICIES, LogicalRadixTree, Node
from sglang_sparse.srt import activation
from sglang_sparse.srt.chains import scheduler as chains
from sglang_sparse.srt.state import STATE, sparse

BACKEND = "sglang_sparse"
logger = logging.getLogger("sglang_sparse")


def eviction_key(policy: str | None, config: dict | None):
    """SGLang's own eviction strategy for ``--radix-eviction-policy`` (its ``get_priority`` reads
    the fields the logical tree's nodes have: priority, last_access_time, hit_count)."""
    from sglang.srt.mem_cache.utils import get_eviction_strategy

    policy = (policy or "lru").lower()
    if policy in UNSUPPORTED_EVICTION_POLICIES:
        raise ValueError(f"sglang_sparse's radix cache does not support --radix-eviction-policy {policy}: "
                         f"{UNSUPPORTED_EVICTION_POLICIES[policy]}")
    return get_eviction_strategy(policy, config).get_priority


class SparseRadixCache(UnifiedRadixCache):
    def __init__(self, params) -> None:
        self.tree_on = not params.disable
        self._evict_key = eviction_key(params.eviction_policy, params.eviction_policy_config)
        ctl = STATE.scheduler.controller
        self.unit = ctl.runtime.prefix_unit if ctl is not None and activation.load_config().get("unit_cache") else 0
        self.units_on = bool(self.unit)
        self.tree = self._new_tree(params.page_size)
        if self.units_on:
            ctl.runtime.set_units_reclaim(self.reclaim_units)
            logger.info("sglang_sparse: the radix cache keeps %s's stored payload in units of %d tokens",
                        ctl.runtime.name, self.unit)
        super().__init__(dataclasses.replace(params, disable=True))
        # SGLang reads ``disable`` to tell whether a prefix tree exists (admission of ignore_eos
        # requests, cache-aware policies); the shell's own tree paths it guards are overridden.
        self.disable = not self.tree_on
        self._device = params.token_to_kv_pool_allocator.device

    def _new_tree(self, page_size: int) -> LogicalRadixTree:
        page = math.lcm(page_size, self.unit) if self.unit else page_size  # a unit is never split
        return LogicalRadixTree(page, evict_key=self._evict_key, unit=self.unit)

    # -- lifecycle -----------------------------------------------------------------------------
    def reset(self) -> None:
        """SGLang's cache flush (only when idle): it clears the allocator and req_to_token rows
        next, so chains lose their payloads without freeing them. Cached units go back to the
        method's store."""
        super().reset()
        if self.units_on and self.tree.all_units().numel():
            STATE.scheduler.controller.runtime.drop_units(self.tree.all_units().tolist())
        self.tree = self._new_tree(self.tree.page)
        if STATE.scheduler.chains is not None:
            STATE.scheduler.chains.forget_all("the cache was flushed")

    def supports_prefix_sharing(self) -> bool:
        return self.tree_on

    def supports_fast_match_prefix(self) -> bool:
        return False

    # -- match ---------------------------------------------------------------------------------
    @staticmethod
    def _namespace(key):
        return (key.extra_key, key.cache_salt)

    def match_prefix(self, params) -> MatchResult:
        lent = chains.lend_match(params)
        if lent is not None:
            return lent
        result = self.session.try_match_prefix(params)
        if result is not None:
            return result
        if self.units_on:
            return self._match_units(params)
        if not self.tree_on:
            return self._match_tree(params)
        key = params.key
        tokens = key.raw_token_ids()
        cap = sparse(params.req).probe_cap if params.req is not None else None
        if cap is not None:  # a snapkv pruning probe recomputes its observation window
            tokens = tokens[:cap]
        m = self.tree.match(tokens, self._namespace(key))
        retained = int(m.slots.numel())
        if params.req is not None:
            st = sparse(params.req)
            st.gap = m.length - retained  # logical tokens of the match without KV
            if st.offset is None:
                st.start_offset = st.gap  # the request's rows stand for gap more tokens (engine/rows.py)
        return MatchResult(device_prefix_len=m.length, last_device_node=m.node, last_host_node=m.node,
                           best_match_node=m.node,
                           cache_protected_len=retained if retained < m.length else None)

    def _match_units(self, params) -> MatchResult:
        """The longest cached prefix of whole units: N logical tokens, no rows (P = 0)."""
        req = params.req
        st = sparse(req) if req is not None else None
        if st is not None and st.offset is not None:  # a later chunk: its first extend fixed the start
            return self._match_tree(params)
        m = self.tree.match(params.key.raw_token_ids(), self._namespace(params.key))
        if st is not None:
            st.units = self.tree.path_units(m.node).tolist() if m.length else None
            st.gap = st.start_offset = m.length  # its rows stand for N more tokens (engine/rows.py)
        return MatchResult(device_prefix_len=m.length, last_device_node=m.node, last_host_node=m.node,
                           best_match_node=m.node, cache_protected_len=0 if m.length else None)

    def cache_units(self, req) -> None:
        """A request leaves (``engine/steps.before_release``, while the method still knows it):
        the tree keeps the units of its history that it does not have yet."""
        runtime = STATE.scheduler.controller.runtime
        units = runtime.cached_units(req.rid)
        if not units:
            return
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[: len(units) * self.unit]
        taken = self.tree.insert_units(tokens, torch.tensor(units, dtype=torch.int64),
                                       (req.extra_key, req.cache_salt), priority=req.priority or 0)
        if taken.numel():
            runtime.hold_units(taken.tolist())

    def reclaim_units(self, n: int) -> bool:
        """The method's store is short by ``n`` units: drop unlocked cached units (SGLang's
        eviction order); True if any went."""
        gone = self.tree.evict_units(n)
        if gone.numel():
            STATE.scheduler.controller.runtime.drop_units(gone.tolist())
        return bool(gone.numel())

    def touch_prefix(self, key) -> None:
        if self.tree_on:
            self.tree.match(key.raw_token_ids(), self._namespace(key))

    def path_device_indices(self, node) -> torch.Tensor:
        return self.tree.path_slots(node)[0].to(self._device)

    def prefix_device_indices(self, req) -> torch.Tensor:
        """The P retained slots of the match, padded to N with slot 0 (SGLang's padding slot):
        SGLang writes N prefix entries into the row; the fix-up after allocation keeps P."""
        slots = self.tree.path_slots(req.last_node)[0]
        n = req.prefix_len
        if slots.numel() < n:
            slots = torch.cat([slots, slots.new_zeros(n - slots.numel())])
        return slots[:n].to(self._device)

    # -- insert --------------------------------------------------------------------------------
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        """Insert the request's KV ``[cache_protected_len, up_to)`` and move its lock.

        SGLang passes ``up_to`` in rows at release (``owned_kv_len``, the request is finished)
        and in logical tokens between prefill chunks (``extend_end``); the two differ by the
        request's gap N - P on a pruned path.

        As SGLang's tree does: the inserted path takes the request's priority; once the key
        reaches past the prompt (a finished request), the path is split at the prompt boundary
        and the prompt part gets priority + 1, so eviction drops the output before the prompt;
        a checkpoint with nothing new still refreshes the path's recency."""
        if self.session.try_checkpoint(req, up_to=up_to, **kwargs) or not self.tree_on:
            return
        gap = sparse(req).gap
        logical_end = up_to + gap if req.finished() else up_to
        tokens = list(req.full_untruncated_fill_ids[:logical_end])
        end = len(tokens) - len(tokens) % self.page_size
        kv = req.kv
        ns, priority = (req.extra_key, req.cache_salt), req.priority or 0
        protected = kv.cache_protected_len  # rows [0, protected) are tree slots already
        start = protected + gap  # logical start of what the request computed itself
        if end <= start:
            self.tree.match(tokens[:end], ns)  # nothing new: a lookup refreshes the path
            return
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        own = row[protected: end - gap].to(torch.int64).cpu()
        ins = self.tree.insert(tokens[:end], start, own, ns, priority=priority, inserted_len=kv.cache_inserted_len)
        self.free_tree_slots(ins.duplicates)
        prompt = len(req.origin_input_ids) - len(req.origin_input_ids) % self.page_size
        if 0 < prompt < ins.end:
            self.tree.raise_priority(tokens[:prompt], priority + 1, ns)
        done = ins.end - start
        row[protected: protected + done] = ins.row_slots.to(row.device, row.dtype)
        kv.cache_protected_len = protected + done
        kv.cache_inserted_len = max(kv.cache_inserted_len, ins.end)
        old = req.lock
        req.lock = self.lock(ins.node)
        self.unlock(old)
        req.last_node = ins.node

    # -- locks ---------------------------------------------------------------------------------
    def inc_lock_ref(self, node, *args, **kwargs) -> IncLockRefResult:
        if isinstance(node, Node):
            self.tree.lock(node)
        return IncLockRefResult(delta=0)

    def dec_lock_ref(self, node, params=None, *args, **kwargs) -> DecLockRefResult:
        if isinstance(node, Node):
            self.tree.unlock(node)
        return DecLockRefResult(delta=0)

    def lock(self, node, *args, **kwargs):
        if not isinstance(node, Node):  # a lent chain or streaming-session row: not a tree node
            return None
        self.tree.lock(node)
        return TreeLock(node, DecLockRefParams())

    def unlock(self, lock) -> None:
        if lock is not None and isinstance(lock.node, Node):
            self.tree.unlock(lock.node)

    def on_release(self, req, *, checkpointed: bool) -> None:
        sparse(req).gap = 0
        if checkpointed:
            chains.pin_path(self, req)

    # -- capacity ------------------------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        freed = self.tree.evict(params.num_tokens)
        self.free_tree_slots(freed)
        return EvictResult(num_tokens_evicted=int(freed.numel()))

    def evict_for_alloc(self, params: EvictParams, *, allocation_reclaim_satisfied=None) -> EvictResult:
        return self.evict(params)

    def free_tree_slots(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self.token_to_kv_pool_allocator.free(slots.to(self._device))

    def evictable_size(self) -> int:
        return self.tree.evictable

    def full_evictable_size(self) -> int:
        return self.tree.evictable

    def protected_size(self) -> int:
        return self.tree.protected

    def full_protected_size(self) -> int:
        return self.tree.protected

    def total_size(self):
        return self.tree.total_retained()

    def sanity_check(self) -> None:
        self.tree.check()

    def is_root(self, node) -> bool:
        return isinstance(node, Node) and node.parent is None

    def root_node_handle(self, extra_key=None):
        return self.tree.root((extra_key, None), create=False)

    def pretty_print(self) -> None:
        print(f"sglang_sparse radix tree: {sum(1 for _ in self.tree.nodes())} nodes, "
              f"{self.tree.total_retained()} retained slots, evictable {self.tree.evictable}, "
              f"protected {self.tree.protected}")

    # -- Chain Cache -----------------------------------------------------------------------------
    def claim_kv_row(self, req) -> bool:
        return chains.park_row(self, req) or super().claim_kv_row(req)

    def session_records(self) -> dict:
        return {**super().session_records(), **chains.parked_records()}


def create(ctx):
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    return create_unified_radix_cache(ctx, cache_class=SparseRadixCache)
