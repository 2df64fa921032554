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
    # [num_layers, kv_heads, n_rows] int64, or None while identity (no eviction yet).
    positions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def offset(self) -> int:
        return self.logical_len - self.n_rows

    @property
    def is_identity(self) -> bool:
        return self.positions is None

    def append(self, n: int) -> None:
        """n new tokens got KV in new rows (prefill chunk or decode): logical and rows grow."""
        if self.positions is not None:
            new = torch.arange(self.logical_len, self.logical_len + n, dtype=torch.int64)
            new = new.expand(self.num_layers, self.kv_heads, n)
            self.positions = torch.cat([self.positions, new], dim=2)
        self.logical_len += n
        self.n_rows += n

    def rows_of(self, logical: torch.Tensor) -> torch.Tensor:
        """Rows holding the given logical positions ``[num_layers, kv_heads, k]`` (must be
        resident)."""
        if self.positions is None:
            return logical.clone()
        rows = torch.searchsorted(self.positions, logical)
        if bool((self.positions.gather(2, rows.clamp(max=self.n_rows - 1)) != logical).any()):
            raise KeyError("a requested logical position has no KV (evicted or not computed)")
        return rows

    def all_positions(self) -> torch.Tensor:
        if self.positions is not None:
            return self.positions
        return torch.arange(self.n_rows).expand(self.num_layers, self.kv_heads, self.n_rows)

    def keep(self, logical: torch.Tensor) -> None:
        """After compaction: rows ``[0, k)`` hold ``logical`` (``[layers, heads, k]``, ascending)."""
        self.positions = logical.clone()
        self.n_rows = logical.shape[2]
