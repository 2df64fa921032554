"""Retained-slot map of one request: which logical positions still have KV, and in which row.

```
 logical positions  0 ............................ L-1 | L ...... L+n-1     (prompt | decoded)
 rows (resident)    0 ........ B-1 | B ...... B+n-1                          (after compaction)
                    retained prompt  decoded tokens, appended in order
 positions[l, h, i] = logical position held by row i in layer l, KV head h   (ascending in i)
 offset = logical_len - n_rows   (logical tokens without KV; RoPE of new tokens uses logical)
```

Before any eviction the map is the identity (``positions is None``): row i holds position i.
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

    @property
    def offset(self) -> int:
        return self.logical_len - self.n_rows

    @property
    def is_identity(self) -> bool:
        return self.kept is None

    @property
    def positions(self) -> torch.Tensor | None:
        """``[num_layers, kv_heads, n_rows]``: the logical position held by every row (None
        while identity). Built on demand."""
        if self.kept is None:
            return None
        tail = self.n_rows - self.kept.shape[2]
        new = torch.arange(self.logical_len - tail, self.logical_len, dtype=torch.int64)
        return torch.cat([self.kept, new.expand(self.num_layers, self.kv_heads, tail)], dim=2)

    def append(self, n: int) -> None:
        """n new tokens got KV in new rows (prefill chunk or decode): logical and rows grow."""
        self.logical_len += n
        self.n_rows += n

    def rows_of(self, logical: torch.Tensor) -> torch.Tensor:
        """Rows holding the given logical positions ``[num_layers, kv_heads, k]`` (must be
        resident)."""
        positions = self.positions
        if positions is None:
            return logical.clone()
        rows = torch.searchsorted(positions, logical)
        if bool((positions.gather(2, rows.clamp(max=self.n_rows - 1)) != logical).any()):
            raise KeyError("a requested logical position has no KV (evicted or not computed)")
        return rows

    def all_positions(self) -> torch.Tensor:
        positions = self.positions
        if positions is not None:
            return positions
        return torch.arange(self.n_rows).expand(self.num_layers, self.kv_heads, self.n_rows)

    def keep(self, logical: torch.Tensor) -> None:
        """After compaction: rows ``[0, k)`` hold ``logical`` (``[layers, heads, k]``, ascending)."""
        self.kept = logical.clone()
        self.n_rows = logical.shape[2]
