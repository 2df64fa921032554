"""Two KV tiers for a method that moves cold KV out of the engine's pool (RetroInfer), torch only.

- ``HostRows``, the host tier: per request and layer, the K / V of the rows a method moved out of
  the device, grouped per KV head by cluster (cluster ``c`` of head ``g`` is the run
  ``[offsets[g, c], offsets[g, c + 1])`` of that head's rows). Pinned host memory when the device
  is CUDA (so a fetch can be an async copy), plain CPU memory otherwise. ``capacity_bytes`` bounds
  what it may hold; ``put`` refuses (returns False) past it.
- ``ClusterCache``, the device tier: an LRU cache of clusters (one entry = one cluster of one KV
  head in one layer of one request, its K and V rows), bounded in rows; a miss copies the
  cluster's rows from ``HostRows`` to the device, and inserting evicts the least recently used
  entries until the rows fit.

On a CPU-only machine both tiers are CPU memory, but two separate regions: a fetch copies (the
cache never aliases the host tensors), so the mechanism (copies, LRU order, hits, misses, bytes)
is the same one that runs with a GPU and is tested in CI. Entries are separate tensors from
torch's allocator, not slices of one preallocated region; the capacities are limits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class HostLayer:
    """One request's rows of one layer on the host: ``k`` / ``v`` ``[H_kv, n, d]`` (per head, rows
    sorted by cluster), ``offsets`` ``[H_kv, C + 1]`` int64 (CPU)."""

    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


class HostRows:
    def __init__(self, device: torch.device | str, capacity_bytes: int) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda"
        self.capacity_bytes = capacity_bytes
        self.layers: dict[tuple[str, int], HostLayer] = {}
        self.bytes_used = 0
        self.bytes_peak = 0

    def fits(self, nbytes: int) -> bool:
        return self.bytes_used + nbytes <= self.capacity_bytes

    def put(self, rid: str, layer: int, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor) -> bool:
        """Copy ``k`` / ``v`` ``[H_kv, n, d]`` (any device, per head in cluster order) to the host.
        False (nothing stored) when it would exceed the capacity."""
        nbytes = k.numel() * k.element_size() * 2
        if not self.fits(nbytes):
            return False
        hk = torch.empty(k.shape, dtype=k.dtype, device="cpu", pin_memory=self.pin)
        hv = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=self.pin)
        hk.copy_(k)
        hv.copy_(v)
        old = self.layers.pop((rid, layer), None)
        if old is not None:
            self.bytes_used -= old.nbytes
        self.layers[(rid, layer)] = HostLayer(hk, hv, offsets.to("cpu", torch.int64))
        self.bytes_used += nbytes
        self.bytes_peak = max(self.bytes_peak, self.bytes_used)
        return True

    def cluster(self, rid: str, layer: int, head: int, cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host views of one cluster's K / V rows ``[size, d]``."""
        e = self.layers[(rid, layer)]
        start, end = int(e.offsets[head, cluster]), int(e.offsets[head, cluster + 1])
        return e.k[head, start:end], e.v[head, start:end]

    def drop(self, rid: str) -> int:
        """Forget a request's rows; returns the bytes freed."""
        freed = 0
        for key in [key for key in self.layers if key[0] == rid]:
            freed += self.layers.pop(key).nbytes
        self.bytes_used -= freed
        return freed

    def requests(self) -> int:
        return len({rid for rid, _ in self.layers})


class ClusterCache:
    """LRU of clusters on ``device``, at most ``capacity_rows`` rows (one row: K and V of one
    token in one KV head and layer). Key: ``(rid, layer, head, cluster)``."""

    def __init__(self, host: HostRows, device: torch.device | str, capacity_rows: int, row_bytes: int) -> None:
        self.host = host
        self.device = torch.device(device)
        self.capacity_rows = capacity_rows
        self.row_bytes = row_bytes  # bytes of one row: K and V of one token, one KV head
        self.entries: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.rows_used = 0
        self.bytes_used = 0
        self.hits = self.misses = self.evictions = 0

    @property
    def bytes_total(self) -> int:
        return self.capacity_rows * self.row_bytes

    def get(self, rid: str, layer: int, head: int, cluster: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cluster's K / V ``[size, d]`` on the device: a hit refreshes its LRU position, a
        miss copies it from the host tier and evicts the least recently used entries until the
        rows fit. A cluster larger than the whole cache is returned without being kept."""
        key = (rid, layer, head, cluster)
        hit = self.entries.get(key)
        if hit is not None:
            self.hits += 1
            self.entries.move_to_end(key)
            return hit
        self.misses += 1
        hk, hv = self.host.cluster(rid, layer, head, cluster)
        # a copy into device memory (on a CPU machine: a second CPU region, never a view)
        k = torch.empty(hk.shape, dtype=hk.dtype, device=self.device)
        v = torch.empty(hv.shape, dtype=hv.dtype, device=self.device)
        k.copy_(hk, non_blocking=True)
        v.copy_(hv, non_blocking=True)
        rows = k.shape[0]
        if rows > self.capacity_rows:
            return k, v
        while self.rows_used + rows > self.capacity_rows:
            self._pop_oldest()
        self.entries[key] = (k, v)
        self.rows_used += rows
        self.bytes_used += k.nbytes + v.nbytes
        return k, v

    def _forget(self, key: tuple) -> None:
        k, v = self.entries.pop(key)
        self.rows_used -= k.shape[0]
        self.bytes_used -= k.nbytes + v.nbytes

    def _pop_oldest(self) -> None:
        self._forget(next(iter(self.entries)))
        self.evictions += 1

    def drop(self, rid: str) -> None:
        """Forget a request's clusters (not counted as evictions)."""
        for key in [key for key in self.entries if key[0] == rid]:
            self._forget(key)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "entries": len(self.entries), "rows_used": self.rows_used, "capacity_rows": self.capacity_rows,
                "bytes_used": self.bytes_used, "bytes_total": self.bytes_total}
