"""Retained-slot map of one request: which logical positions still have KV, and in which row.

```
 logical positions  0 ............................ L-1 | L ...... L+n-1     (prompt | decoded)
 rows (resident)    0 ........ B-1 | B ...... B+n-1                          (after compaction)
                    retained prompt  decoded tokens, appended in order
 positions[l, h, i] = logical position held by row i in layer l, KV head h   (ascending in i)
 offset = logical_len - n_rows   (logical tokens without KV; RoPE of new tokens uses logical)
```

Before any eviction the map is the identity (``positions is None``): row i holds position i.

Per-layer form (PyramidKV and other per-layer or global budgets, docs/kv_payload.md): after a
per-layer compaction layer l keeps its own ``B_l`` rows, and the engine's rows ``[0, K)`` are only
the slots whose cells hold them (``K = ceil(sum_l B_l / num_layers)``):

```
 layer l, row i < B_l      -> position layer_kept[l][h, i], stored in flat cell cells[l][i]
 layer l, row B_l + t      -> position logical_len - tail + t, in the cell of engine row K + t
 n_rows = K + tail         (the engine's rows: what SGLang allocates and frees)
 layer_len(l) = B_l + tail (what attention in layer l reads)
```
A flat cell is ``layer * slots_per_layer + slot`` of the store's one K (and V) tensor over all
layers, so a layer's rows may live in another layer's part of the pool (``kv_store``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RetainedMap:
    num_layers: int
    kv_heads: int
    logical_len: int = 0
    n_rows: int = 0
    # [num_layers, kv_heads, k] int64: logical positions of rows [0, k) chosen by the last
    # compaction, or None while identity (no eviction yet). Rows [k, n_rows) were appended
    # since, in order, and hold logical positions [logical_len - (n_rows - k), logical_len) in
    # every layer and head; they are not stored, so a decode step costs O(1), not O(n_rows).
    kept: torch.Tensor | None = field(default=None, repr=False)
    # Per-layer form (see the module docstring): kept positions [kv_heads, B_l] and their flat
    # cells [B_l] per layer, and K, the engine rows of the compacted region. None: uniform form.
    layer_kept: list[torch.Tensor] | None = field(default=None, repr=False)
    cells: list[torch.Tensor] | None = field(default=None, repr=False)
    compacted_rows: int = 0

    def host_kept(self) -> torch.Tensor | None:
        """``kept`` on the host as int64 (what every reader gets). A wave of compactions on the
        device (``CacheManager.compact_rows_many``) leaves it there, int32; it comes back here, once,
        when the host reads it (a retention map, a parked chain), not at every eviction."""
        self.kept = _on_host(self.kept)
        return self.kept

    def device_kept(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        """``kept`` on ``device`` as ``dtype`` (moved there and left there), or None while identity:
        the device side of ``host_kept``, for a compaction that gathers positions where its rows
        are instead of copying the rows to the host."""
        if self.kept is not None and (self.kept.device != torch.device(device) or self.kept.dtype != dtype):
            self.kept = self.kept.to(device, dtype)
        return self.kept

    def __deepcopy__(self, memo) -> "RetainedMap":
        """A copy (a parked or lent chain) keeps its positions on the host, not in device memory."""
        kept = _on_host(self.kept)  # the original stays where it is
        if kept is not None:  # a token-uniform map stays an expanded [k] (compact_tokens re-points rows)
            kept = kept[0, 0].clone().expand(kept.shape) if _token_uniform(kept) else kept.clone()
        other = RetainedMap(self.num_layers, self.kv_heads, self.logical_len, self.n_rows, kept,
                            None if self.layer_kept is None else [x.clone() for x in self.layer_kept],
                            None if self.cells is None else [x.clone() for x in self.cells], self.compacted_rows)
        memo[id(self)] = other
        return other

    @property
    def offset(self) -> int:
        return self.logical_len - self.n_rows

    @property
    def is_identity(self) -> bool:
        return self.kept is None

    @property
    def per_layer(self) -> bool:
        return self.layer_kept is not None

    @property
    def tail(self) -> int:
        """Rows appended since the last per-layer compaction (identity in every layer)."""
        return self.n_rows - self.compacted_rows

    def layer_len(self, layer: int) -> int:
        """Rows attention reads in ``layer``."""
        if self.layer_kept is None:
            return self.n_rows
        return self.layer_kept[layer].shape[1] + self.tail

    def layer_positions(self, layer: int) -> torch.Tensor:
        """``[kv_heads, layer_len(layer)]``: the logical position of every row of one layer."""
        if self.layer_kept is None:
            return self.all_positions()[layer]
        new = torch.arange(self.logical_len - self.tail, self.logical_len, dtype=torch.int64)
        return torch.cat([self.layer_kept[layer], new.expand(self.kv_heads, self.tail)], dim=1)

    @property
    def positions(self) -> torch.Tensor | None:
        """``[num_layers, kv_heads, n_rows]``: the logical position held by every row (None
        while identity). Built on demand. Per-layer maps have no common shape: use
        ``layer_positions``."""
        if self.layer_kept is not None:
            raise ValueError("a per-layer retained map has one row count per layer: use layer_positions")
        kept = self.host_kept()
        if kept is None:
            return None
        tail = self.n_rows - kept.shape[2]
        new = torch.arange(self.logical_len - tail, self.logical_len, dtype=torch.int64)
        return torch.cat([kept, new.expand(self.num_layers, self.kv_heads, tail)], dim=2)

    def append(self, n: int) -> None:
        """n new tokens got KV in new rows (prefill chunk or decode): logical and rows grow."""
        self.logical_len += n
        self.n_rows += n

    def layer_rows_of(self, layer: int, logical: torch.Tensor) -> torch.Tensor:
        """Rows of ``layer`` holding the positions ``[kv_heads, k]`` (must be resident)."""
        if self.kept is None and self.layer_kept is None:
            return logical.clone()
        positions = self.layer_positions(layer)
        rows = torch.searchsorted(positions, logical.contiguous())
        if bool((positions.gather(1, rows.clamp(max=positions.shape[1] - 1)) != logical).any()):
            raise KeyError("a requested logical position has no KV (evicted or not computed)")
        return rows

    def rows_of(self, logical: torch.Tensor) -> torch.Tensor:
        """Rows holding the given logical positions ``[num_layers, kv_heads, k]`` (must be
        resident)."""
        positions = self.positions
        if positions is None:
            return logical.clone()
        rows = torch.searchsorted(positions, logical.contiguous())
        if bool((positions.gather(2, rows.clamp(max=self.n_rows - 1)) != logical).any()):
            raise KeyError("a requested logical position has no KV (evicted or not computed)")
        return rows

    def token_positions(self) -> torch.Tensor | None:
        """``[n_rows]``: the logical position of every row when it is the same in every layer and
        KV head (identity, or only token-uniform compactions so far); None otherwise."""
        if self.layer_kept is not None:
            return None
        kept = self.host_kept()
        if kept is None:
            return torch.arange(self.n_rows)
        if not _token_uniform(kept):
            return None
        tail = self.n_rows - kept.shape[2]
        return torch.cat([kept[0, 0], torch.arange(self.logical_len - tail, self.logical_len)])

    def all_positions(self) -> torch.Tensor:
        positions = self.positions
        if positions is not None:
            return positions
        return torch.arange(self.n_rows).expand(self.num_layers, self.kv_heads, self.n_rows)

    def keep(self, logical: torch.Tensor, owned: bool = False) -> None:
        """After compaction: rows ``[0, k)`` hold ``logical`` (``[layers, heads, k]``, ascending).
        ``owned``: the caller hands over a fresh tensor nobody else holds (kept without a copy)."""
        if self.layer_kept is not None:
            raise ValueError("a per-layer retained map is compacted per layer (keep_layers)")
        if _token_uniform(logical):  # the same in every layer and head
            self.kept = logical[0, 0].clone().expand(logical.shape)
        else:
            self.kept = logical if owned else logical.clone()
        self.n_rows = logical.shape[2]

    def keep_layers(self, logical: list[torch.Tensor], cells: list[torch.Tensor], engine_rows: int) -> None:
        """After a per-layer compaction: layer l holds ``logical[l]`` (``[heads, B_l]``) in flat
        cells ``cells[l]``, all inside the engine's first ``engine_rows`` rows."""
        self.kept = None
        self.layer_kept = [x.clone() for x in logical]
        self.cells = cells
        self.compacted_rows = self.n_rows = engine_rows


def _on_host(kept: torch.Tensor | None) -> torch.Tensor | None:
    """``kept`` as host int64 (itself when it is already; a token-uniform one stays expanded)."""
    if kept is None or (kept.device.type == "cpu" and kept.dtype == torch.int64):
        return kept
    if _token_uniform(kept):
        return kept[0, 0].to("cpu", torch.int64).expand(kept.shape)
    return kept.to("cpu", torch.int64)


def _token_uniform(t: torch.Tensor) -> bool:
    """``[layers, heads, k]`` expanded from one ``[k]`` (the same positions in every layer and
    head). A size-1 dimension counts as uniform whatever its stride (``expand`` keeps it): one KV
    head per rank under tensor parallelism."""
    return all(t.stride(d) == 0 or t.shape[d] == 1 for d in (0, 1))
