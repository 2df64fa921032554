"""Per-layer row tables on the device, for decode inside CUDA graphs (engine-agnostic).

A request with a per-layer ``RetainedMap`` (PyramidKV) reads, in layer l, its ``B_l`` packed
rows (flat cells ``retained.cells[l]``) and then the rows appended since the compaction, which
sit in engine rows ``[K, n_rows)`` of its slot table (``K = retained.compacted_rows``). The
decode kernel (``sgl_kernel_sparse.cells_decode_attention``) finds every cell from these
persistent tensors and the engine's slot table, so nothing is built per step:

- ``count[row, l] = B_l``, ``offset[row, l] = B_0 + .. + B_(l-1)``, ``packed_rows[row] = K``
  (0 and 0 for a request without a per-layer map: its view is its slot table, i.e. dense);
- ``entries``: one int per flat cell of the store. The request's packed list (all layers
  concatenated, ``T = sum_l B_l <= K * layers`` entries) is stored in the request's *own* cells:
  entry e at ``(e // K) * slots_per_layer + slot[e % K]``, ``slot`` its first K slots. Own cells
  belong to one request at a time, so requests never overwrite each other's entries.

The tables change only at safe points (start, compaction, chain attach, release), never while a
forward runs; a captured graph reads them through fixed addresses.
"""

from __future__ import annotations

import torch

from sglang_sparse.core.retained import RetainedMap


class CellTables:
    def __init__(self, num_layers: int, slots_per_layer: int, rows: int, device) -> None:
        self.num_layers = num_layers
        self.slots_per_layer = slots_per_layer
        cells = num_layers * slots_per_layer
        dtype = torch.int32 if cells < 2**31 else torch.int64
        self.entries = torch.zeros(cells, dtype=dtype, device=device)
        self.offset = torch.zeros(rows, num_layers, dtype=torch.int32, device=device)
        self.count = torch.zeros(rows, num_layers, dtype=torch.int32, device=device)
        self.packed_rows = torch.zeros(rows, dtype=torch.int32, device=device)

    def clear(self, row: int) -> None:
        """The row's request reads its slot table as is (no per-layer map)."""
        self.count[row] = 0
        self.offset[row] = 0
        self.packed_rows[row] = 0

    def sync(self, row: int, ret: RetainedMap, slots: torch.Tensor | None) -> None:
        """Mirror ``ret`` for the request on engine row ``row``; ``slots`` are its resident slots
        in row order (at least its first ``compacted_rows``; None for a uniform map)."""
        if not ret.per_layer:
            self.clear(row)
            return
        k = ret.compacted_rows
        counts = torch.tensor([c.numel() for c in ret.cells], dtype=torch.int64)
        flat = torch.cat([c.to(torch.int64) for c in ret.cells])
        if flat.numel() > k * self.num_layers:
            raise ValueError(f"{flat.numel()} packed entries do not fit the {k} x {self.num_layers} own cells")
        e = torch.arange(flat.numel())
        addr = (e // k) * self.slots_per_layer + slots[:k].cpu().to(torch.int64)[e % k]
        dev = self.entries.device
        self.entries[addr.to(dev)] = flat.to(dev, self.entries.dtype)
        self.count[row] = counts.to(dev, torch.int32)
        self.offset[row] = (torch.cumsum(counts, 0) - counts).to(dev, torch.int32)
        self.packed_rows[row] = k
