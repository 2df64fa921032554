"""CacheManager: the method-owned side of the KV cache (engine-agnostic).

The engine allocates rows/slots and writes each token's KV as usual; the cache manager keeps,
per request, the retained-slot map (``RetainedMap``) and the method's persistent metadata
(scores, page summaries, ...), and performs physical operations on the store: compaction
(move kept entries into the first rows, free the rest to the allocator) and release.

Lifetimes: state is created by ``start`` and dropped by ``release``; tensors returned by
``retained`` stay valid until the next ``compact`` or ``release`` of that request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from sgl_kernel_sparse import compact_kv

from sglang_sparse.core.cell_tables import CellTables
from sglang_sparse.core.kv_store import KVStore
from sglang_sparse.core.retained import RetainedMap
from sglang_sparse.core.tensor_parallel import SingleRank


@dataclass
class RequestState:
    req_row: int
    prompt_len: int
    retained: RetainedMap
    metadata: dict[str, Any] = field(default_factory=dict)


class CacheManager:
    def __init__(self, store: KVStore, kv_heads: int, heads: SingleRank | None = None) -> None:
        self.store = store
        self.kv_heads = kv_heads  # this rank's KV heads (all of them without tensor parallelism)
        # the tensor-parallel group of KV heads: decisions across heads gather them (tensor_parallel.py)
        self.heads = heads or SingleRank()
        self.requests: dict[str, RequestState] = {}
        self.counters = {"compactions": 0, "slots_released": 0}
        # Device mirror of per-layer maps for graph-safe decode (``enable_cell_tables``), or None.
        self.cell_tables: CellTables | None = None
        self._flat = None  # flat_pool(), once asked: a tuple, or False

    def enable_cell_tables(self) -> CellTables:
        """Keep ``CellTables`` in step with every request's map (methods with per-layer rows
        that decode inside CUDA graphs). Call before the engine captures graphs."""
        if self.cell_tables is None:
            rows, _ = self.store.table_shape()
            flat_k, _ = self.store.flat_kv()
            self.cell_tables = CellTables(self.store.num_layers, flat_k.shape[0] // self.store.num_layers,
                                          rows, flat_k.device)
        return self.cell_tables

    def _sync_tables(self, state: RequestState, slots: torch.Tensor | None = None) -> None:
        """Mirror the request's map into ``cell_tables`` (``slots``: its first ``compacted_rows``
        slots, read from the slot table when not given; unused for a uniform map)."""
        if self.cell_tables is None:
            return
        if slots is None and state.retained.per_layer:
            slots = self.store.row_slots(state.req_row, 0, state.retained.compacted_rows).to(torch.int64)
        self.cell_tables.sync(state.req_row, state.retained, slots)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, rid: str, req_row: int, prompt_len: int, cached_len: int = 0,
              cached_logical: int | None = None, metadata: dict[str, Any] | None = None) -> RequestState:
        """A request enters the engine; ``cached_len`` rows are already resident (prefix hit),
        standing for ``cached_logical`` logical tokens (more than the rows on a pruned prefix, or
        on a prefix a method store holds: then ``metadata`` says where)."""
        state = RequestState(req_row, prompt_len, RetainedMap(self.store.num_layers, self.kv_heads),
                             dict(metadata or {}))
        state.retained.append(cached_len)
        state.retained.logical_len = cached_len if cached_logical is None else cached_logical
        self.requests[rid] = state
        self._sync_tables(state)
        return state

    def attach(self, rid: str, req_row: int, prompt_len: int, retained: RetainedMap,
               metadata: dict[str, Any]) -> RequestState:
        """A request resumes retained state (Chain Cache): its rows ``[0, retained.n_rows)`` hold
        what an earlier request of the chain kept, with the same map and method metadata."""
        state = RequestState(req_row, prompt_len, retained, dict(metadata))
        self.requests[rid] = state
        self._sync_tables(state)
        return state

    def on_written(self, rid: str, n: int) -> None:
        """n tokens of this request got their KV written in new rows this step."""
        self.requests[rid].retained.append(n)

    def release(self, rid: str) -> None:
        """Forget the request. The engine frees the rows it still owns (``[0, n_rows)``)."""
        state = self.requests.pop(rid, None)
        if state is not None and self.cell_tables is not None:
            self.cell_tables.clear(state.req_row)

    # -- physical operations -----------------------------------------------------------------
    def compact(self, rid: str, keep) -> int:
        """Keep the logical positions ``keep`` (``[layers, kv_heads, B]``, ascending per head)
        and release every other row. Row i of layer l / head h then holds ``keep[l, h, i]``.
        Returns the number of slots freed (``n_rows - B``). A list of ``[kv_heads, B_l]``
        (one budget per layer) compacts per layer (``compact_layers``)."""
        if isinstance(keep, (list, tuple)):
            return self.compact_layers(rid, list(keep))
        if keep.dim() == 1:
            return self.compact_tokens(rid, keep)
        state = self.requests[rid]
        if keep.shape[2] >= state.retained.n_rows:
            return 0
        return self._compact_rows(state, state.retained.rows_of(keep), keep)

    def compact_rows(self, rid: str, rows: torch.Tensor) -> int:
        """``compact`` given the kept *rows* ``[layers, kv_heads, B]`` (ascending per head, any
        device) instead of logical positions: what a method that selects among its rows (H2O,
        R-KV) has at hand, so no position -> row search runs (a ``searchsorted`` over every
        layer and head, ~10 ms of one CPU thread at 36 x 8 x 2K rows)."""
        state = self.requests[rid]
        ret = state.retained
        if rows.dim() != 3 or tuple(rows.shape[:2]) != (self.store.num_layers, ret.kv_heads):
            raise ValueError(f"kept rows must be [layers, kv_heads, B] = [{self.store.num_layers}, {ret.kv_heads}, B], "
                             f"got {tuple(rows.shape)}")
        return self.compact_rows_many([rid], rows.unsqueeze(0))[0]  # (its checks, and no copy of rows to the host)

    def compact_rows_many(self, rids: list[str], rows: torch.Tensor) -> list[int]:
        """``compact_rows`` for several requests at one safe point, ``rows [R, layers, kv_heads,
        B]`` (request i keeps ``rows[i]``): one check on the device for all of them (one read
        back), then, for requests holding the same number of rows (a decode wave), work that does
        not grow with the batch (``_compact_equal``): one read of the slot table, their new
        positions gathered as one tensor, one KV move over every layer of a flat pool (else one
        per layer; their slots are disjoint: a slot holds one row of one request), one release to
        the allocator. Returns the slots freed per request."""
        states = [self.requests[rid] for rid in rids]
        if rows.dim() != 4 or rows.shape[0] != len(rids) or any(
                tuple(rows.shape[1:3]) != (self.store.num_layers, s.retained.kv_heads) for s in states):
            raise ValueError(f"kept rows must be [requests, layers, kv_heads, B] = [{len(rids)}, "
                             f"{self.store.num_layers}, {self.kv_heads}, B], got {tuple(rows.shape)}")
        budget, rows = rows.shape[3], rows.long()
        todo = [i for i, s in enumerate(states) if budget < s.retained.n_rows]
        if not todo:
            return [0] * len(rids)
        rows = rows[todo] if len(todo) < len(rids) else rows
        held = [states[i].retained.n_rows for i in todo]
        n = torch.tensor(held, device=rows.device).view(-1, 1, 1, 1)
        # every check on the device, one read back (one request's refusal refuses the batch: a
        # method's plan is wrong, nothing has moved yet)
        bad = torch.stack([(rows < 0).any(), (rows >= n).any(), (rows.diff(dim=-1) <= 0).any()]).cpu()
        if bool(bad[0]) or bool(bad[1]):
            raise IndexError(f"kept rows must lie in [0, n_rows) of their request (n_rows {held[0] if len(held) == 1 else held}), "
                             f"got [{int(rows.min())}, {int(rows.max())}]")
        if bool(bad[2]):
            raise ValueError("kept rows must be strictly ascending per layer and KV head")
        batch = [states[i] for i in todo]
        groups: dict[int, list[int]] = {}  # requests holding the same number of rows compact together
        for j, count in enumerate(held):
            groups.setdefault(count, []).append(j)
        freed = [0] * len(batch)
        for js in groups.values():
            part = rows if len(js) == len(batch) else rows[torch.tensor(js, device=rows.device)]
            for j, f in zip(js, self._compact_equal([batch[j] for j in js], part)):
                freed[j] = f
        got = [0] * len(rids)
        for i, f in zip(todo, freed):
            got[i] = f
        self.counters["compactions"] += len(todo)
        self.counters["slots_released"] += sum(freed)
        return got

    def _compact_equal(self, states: list[RequestState], rows: torch.Tensor) -> list[int]:
        """Requests that all hold ``n`` rows keep ``rows [R, layers, kv_heads, B]`` (checked):
        request r's row i of layer l / head h takes the entry of row ``rows[r, l, h, i]`` and
        holds the position that row held; rows ``[B, n)`` are released. A constant number of
        device operations whatever R (a wave's host time was its launches, one set per request)."""
        layers, heads, budget = rows.shape[1:]
        n = states[0].retained.n_rows
        slots = self._rows_slots(states, n)  # [R, n] int64
        rows_here = rows.to(slots.device)
        src = slots.gather(1, rows_here.flatten(1)).view(rows_here.shape)  # [R, L, H, B] source slots
        # The new positions are gathered where the rows are: no copy of the rows to the host (on
        # an H100 a wave of 179 requests' rows, 840 MB of int64, took 0.45 s to copy). Off the CPU
        # the maps' positions stay on the device as int32 until the host reads them
        # (RetainedMap.host_kept). Each request keeps a view of the batch's [R, L, H, B] tensor,
        # freed once every one of them is compacted again, released or parked (a parked copy is
        # the host's own: RetainedMap.__deepcopy__).
        dtype = torch.int64 if rows.device.type == "cpu" else torch.int32
        kept = self._positions(states, n, rows.device, dtype).gather(3, rows)
        for j, state in enumerate(states):
            state.retained.keep(kept[j], owned=True)
            self.store.truncate_rows(state.req_row, budget)
        self._move_rows(src, slots[:, :budget])
        self.store.free_slots(slots[:, budget:].flatten())  # no row points at these any more
        return [n - budget] * len(states)

    def _positions(self, states: list[RequestState], n: int, device, dtype) -> torch.Tensor:
        """``[R, layers, kv_heads, n]``: the logical position each row of each request holds (all
        holding ``n`` rows), on ``device``: identity maps, or the last compaction's kept positions
        followed by the rows appended since (``RetainedMap``: rows ``[k, n)`` hold positions
        ``[logical_len - (n - k), logical_len)``)."""
        layers, heads = self.store.num_layers, states[0].retained.kv_heads
        count = len(states)
        kept = [s.retained.device_kept(device, dtype) for s in states]
        widths = {k.shape[2] for k in kept if k is not None}
        if all(k is None for k in kept):  # identity: row r holds position r
            return torch.arange(n, device=device, dtype=dtype).expand(count, layers, heads, n)
        if len(widths) == 1 and all(k is not None for k in kept):
            width = widths.pop()
            out = torch.stack(kept)  # [R, L, H, width]
        else:  # mixed: each request's own [L, H, n] (one request never reaches this branch)
            width, out = n, torch.cat([self._positions([s], n, device, dtype) for s in states])
        tail = n - width
        if tail:
            start = torch.tensor([s.retained.logical_len - tail for s in states], dtype=dtype).to(device)
            new = start.view(-1, 1) + torch.arange(tail, device=device, dtype=dtype)  # [R, tail]
            out = torch.cat([out, new.view(count, 1, 1, tail).expand(count, layers, heads, tail)], dim=3)
        return out

    def _move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Request r's row i of layer l / head h takes the KV of slot ``src[r, l, h, i]`` into slot
        ``dst[r, i]``, every layer. A flat pool: one in-place move over flat cells, entries in
        runs of B per (request, layer) in row order (``compact_kv(segment=B)``: a compaction
        never reads a row that an earlier entry of its run wrote). Else one move per layer."""
        count, layers, heads, budget = src.shape
        flat = self.flat_pool()
        if flat is None:
            for layer in range(layers):
                # sources are read before any destination is written (a request's ranges overlap)
                self.store.move_kv(layer, src[:, layer].transpose(0, 1).reshape(heads, -1), dst.reshape(-1))
            return
        flat_k, flat_v, per_layer = flat
        base = torch.arange(layers, device=src.device) * per_layer  # cell of (layer l, slot 0)
        src_cells = (src + base.view(1, layers, 1, 1)).permute(2, 0, 1, 3).reshape(heads, -1)  # [H, R*L*B]
        dst_cells = (dst.view(count, 1, budget) + base.view(1, layers, 1)).reshape(-1)  # [R*L*B]
        compact_kv(flat_k, flat_v, src_cells.to(flat_k.device), dst_cells.to(flat_k.device), segment=budget)

    def flat_pool(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``(flat K, flat V, slots per layer)`` when the store keeps every layer in one tensor of
        the KV's own dtype (``[layers * S, H, d]``, layer l's slot s at cell ``l * S + s``); None
        otherwise: per-layer buffers, or an fp8 pool stored as bytes (its flat tensor holds no
        numbers). Asked once: the pool never changes."""
        if self._flat is None:
            self._flat = False
            try:
                k, v = self.store.flat_kv()
            except (RuntimeError, AttributeError, NotImplementedError):
                k = None
            if k is not None and k.dtype == self.store.k_buffer(0).dtype:
                self._flat = (k, v, k.shape[0] // self.store.num_layers)
        return self._flat or None

    def _compact_rows(self, state: RequestState, src_rows: torch.Tensor, keep: torch.Tensor) -> int:
        """Row i of layer l / KV head h takes the entry of row ``src_rows[l, h, i]`` (>= i), which
        holds logical position ``keep[l, h, i]``; rows ``[B, n_rows)`` are released."""
        ret = state.retained
        layers, _, budget = keep.shape
        slots = self._resident_slots(state)
        src = slots[src_rows.to(slots.device)]  # [layers, heads, B] source slots, one copy to the device
        for layer in range(layers):
            # sources are read before any destination is written (they overlap)
            self.store.move_kv(layer, src[layer], slots[:budget])
        ret.keep(keep)  # a uniform map stays uniform: its row's tables stay clear (set at start)
        return self._release_rows(state, slots[budget:], budget)

    def compact_tokens(self, rid: str, keep: torch.Tensor) -> int:
        """Keep the logical positions ``keep`` (``[B]``, ascending) in every layer and KV head.
        While the request's rows hold the same position in every layer and head (identity, or
        token-uniform compactions only: StreamingLLM, KIVI), no KV moves: a slot holds one
        token's KV of every layer, so rows ``[0, B)`` are re-pointed at the kept rows' slots and
        the other slots are freed. Otherwise (a per-head map) the kept rows are moved as
        ``compact`` does. Returns the number of slots freed."""
        state = self.requests[rid]
        ret = state.retained
        if keep.numel() >= ret.n_rows:
            return 0
        have = ret.token_positions()
        expanded = keep.view(1, 1, -1).expand(self.store.num_layers, ret.kv_heads, -1)
        if have is None:
            return self.compact(rid, expanded)
        rows = torch.searchsorted(have, keep)
        if bool((have[rows.clamp(max=len(have) - 1)] != keep).any()):
            raise KeyError("a requested logical position has no KV (evicted or not computed)")
        slots = self._resident_slots(state)  # may be a view of the table rewritten below
        dropped = torch.ones(ret.n_rows, dtype=torch.bool)
        dropped[rows] = False
        freed = slots[dropped.to(slots.device)]  # (advanced indexing: copies)
        self.store.set_row_slots(state.req_row, slots[rows.to(slots.device)])
        ret.keep(expanded)
        return self._release_rows(state, freed, keep.numel())

    def compact_layers(self, rid: str, keep: list[torch.Tensor]) -> int:
        """Per-layer budgets: layer l keeps the positions ``keep[l]`` (``[kv_heads, B_l]``,
        ascending per head). The kept entries of all layers (``T = sum_l B_l`` cells) are packed
        into the cells of the request's first ``K = ceil(T / layers)`` slots, each layer in its
        own part of those slots first, the overflow of large layers in the cells that small
        layers leave unused; slots ``[K, n_rows)`` are freed whole. Memory freed is what every
        layer dropped, summed (up to one slot of rounding). Returns slots freed."""
        state = self.requests[rid]
        ret, store = state.retained, self.store
        layers = store.num_layers
        budgets = [int(k.shape[1]) for k in keep]
        engine_rows = -(-sum(budgets) // layers)
        if engine_rows >= ret.n_rows:
            return 0
        slots = self._resident_slots(state)
        src = torch.cat([self._layer_cells(ret, layer, slots)[ret.layer_rows_of(layer, keep[layer])]
                         for layer in range(layers)], dim=1)  # [kv_heads, T] source cells
        kept_slots = slots[:engine_rows]
        own = [store.cells(layer, kept_slots[: min(b, engine_rows)]) for layer, b in enumerate(budgets)]
        spare = torch.cat([store.cells(layer, kept_slots[b:]) for layer, b in enumerate(budgets)
                           if b < engine_rows] or [slots.new_zeros(0)])
        dst, used = [], 0
        for layer, b in enumerate(budgets):  # overflow of layer l: the next spare cells
            extra = max(0, b - engine_rows)
            dst.append(torch.cat([own[layer], spare[used: used + extra]]))
            used += extra
        flat_k, flat_v = store.flat_kv()
        # one move over every layer: all sources are read before any destination is written
        compact_kv(flat_k, flat_v, src.to(flat_k.device), torch.cat(dst).to(flat_k.device))
        ret.keep_layers(keep, [d.cpu() for d in dst], engine_rows)
        self._sync_tables(state, kept_slots)
        return self._release_rows(state, slots[engine_rows:], engine_rows)

    def _release_rows(self, state: RequestState, freed: torch.Tensor, rows: int) -> int:
        """After a compaction: the request keeps engine rows ``[0, rows)``; ``freed``, the slots
        no row points at any more, go back to the allocator."""
        freed = freed.clone()
        self.store.truncate_rows(state.req_row, rows)
        self.store.free_slots(freed)
        self.counters["compactions"] += 1
        self.counters["slots_released"] += len(freed)
        return len(freed)

    def layer_cells(self, rid: str, layer: int) -> torch.Tensor:
        """Flat cells of a request's rows in ``layer``, in row order (``layer_len`` of them)."""
        state = self.requests[rid]
        return self._layer_cells(state.retained, layer, self._resident_slots(state))

    def _layer_cells(self, ret: RetainedMap, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """``layer_cells`` given the request's resident slots (read once per compaction)."""
        if not ret.per_layer:
            return self.store.cells(layer, slots)
        tail = self.store.cells(layer, slots[ret.compacted_rows:])
        return torch.cat([ret.cells[layer].to(tail.device), tail])

    # -- queries -----------------------------------------------------------------------------
    def retained(self, rid: str) -> RetainedMap:
        return self.requests[rid].retained

    def _resident_slots(self, state: RequestState) -> torch.Tensor:
        """Slots of the request's resident rows ``[0, n_rows)``, in row order."""
        return self.store.row_slots(state.req_row, 0, state.retained.n_rows).to(torch.int64)

    def resident_slots_many(self, rids: list[str]) -> torch.Tensor:
        """``[R, n]``: the slots of the resident rows of requests that all hold ``n`` rows (a wave
        planned together), one read of the slot table, on its device."""
        states = [self.requests[rid] for rid in rids]
        n = states[0].retained.n_rows
        if any(s.retained.n_rows != n for s in states):
            raise ValueError(f"requests hold {sorted({s.retained.n_rows for s in states})} rows: one count only")
        return self._rows_slots(states, n)

    def _rows_slots(self, states: list[RequestState], n: int) -> torch.Tensor:
        """``[R, n]`` int64: the slots of rows ``[0, n)`` of each request, one read of the slot table."""
        return self.store.rows_slots(torch.tensor([s.req_row for s in states]), n).to(torch.int64)

    def resident_slots(self, rid: str) -> torch.Tensor:
        """Slots of a request's resident rows ``[0, n_rows)`` in row order (valid until its rows
        change)."""
        return self._resident_slots(self.requests[rid])

    def keys(self, rid: str, layer: int) -> torch.Tensor:
        """Resident keys of a request in row order: ``[layer_len, kv_heads, d]``."""
        if self.requests[rid].retained.per_layer:
            return self.store.flat_kv()[0][self.layer_cells(rid, layer)]
        return self.store.k_buffer(layer)[self._resident_slots(self.requests[rid])]

    def values(self, rid: str, layer: int) -> torch.Tensor:
        """Resident values of a request in row order: ``[layer_len, kv_heads, d]``."""
        if self.requests[rid].retained.per_layer:
            return self.store.flat_kv()[1][self.layer_cells(rid, layer)]
        return self.store.v_buffer(layer)[self._resident_slots(self.requests[rid])]

    def totals(self) -> dict[str, int]:
        return {
            "logical_tokens": sum(s.retained.logical_len for s in self.requests.values()),
            "retained_tokens": sum(s.retained.n_rows for s in self.requests.values()),
        }
