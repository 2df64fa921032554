"""Two KV tiers for a method that moves cold KV out of the engine's pool (RetroInfer), torch only.

- ``HostRows``, the host tier: per request and layer, the K / V of the rows a method moved out of
  the device, grouped per KV head by cluster (cluster ``c`` of head ``g`` is the run
  ``[offsets[g, c], offsets[g, c + 1])`` of that head's rows). Pinned host memory when the device
  is CUDA (so a fetch can be an async copy), plain CPU memory otherwise. ``capacity_bytes`` bounds
  what it may hold; ``put`` refuses (returns False) past it.
- ``PageCache``, the device tier (the paper's wave buffer): one preallocated pool of pages, each
  ``page_rows`` rows of one KV head (K and V), allocated once. A cluster of ``s`` rows occupies
  ``ceil(s / page_rows)`` *virtual pages* of its (request, layer, head); ``fetch`` takes a batch of
  clusters, looks every virtual page up in a per-(request, layer) table (numpy, host side),
  copies the missing ones from ``HostRows`` in one gather + one host-to-device copy, and returns
  the pool pages to read. Replacement is CLOCK (a reference bit per page, set on use, cleared as
  the hand passes; pages used by the fetch in progress are never taken), an approximation of LRU
  that costs O(pages taken) per fetch.

On a CPU-only machine both tiers are CPU memory, but two separate regions: a fetch copies (the
pool never aliases the host tensors), so the mechanism (copies, replacement, hits, misses, bytes)
is the same one that runs with a GPU and is tested in CI.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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


@dataclass
class PageLayout:
    """One (request, layer)'s clusters as virtual pages (numpy, host side). Head ``g``'s cluster
    ``c`` is virtual pages ``[start[g, c], start[g, c + 1])``; virtual page ``p`` of head ``g``
    holds host rows ``[row0[g, p], row0[g, p] + length[g, p])`` (indices into that head's rows in
    ``HostLayer``), belongs to ``cluster[g, p]``, and sits in pool page ``pool[g, p]`` (-1: not on
    the device). ``id``: the owner id the page cache records for its pool pages."""

    key: tuple[str, int]
    start: np.ndarray
    row0: np.ndarray
    length: np.ndarray
    cluster: np.ndarray
    pool: np.ndarray
    id: int = -1


def page_layout(key: tuple[str, int], sizes: np.ndarray, page_rows: int) -> PageLayout:
    """Virtual pages of clusters of ``sizes`` ``[H_kv, C]`` rows, rows in cluster order per head."""
    hkv, c = sizes.shape
    pages = -(-sizes // page_rows)  # [H_kv, C]
    start = np.zeros((hkv, c + 1), np.int64)
    np.cumsum(pages, axis=1, out=start[:, 1:])
    n_pages = int(start[:, -1].max()) if c else 0
    row0 = np.zeros((hkv, n_pages), np.int64)
    length = np.zeros((hkv, n_pages), np.int64)
    cluster = np.zeros((hkv, n_pages), np.int64)
    first_row = np.concatenate([np.zeros((hkv, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    for g in range(hkv):
        cl = np.repeat(np.arange(c), pages[g])  # cluster of each virtual page
        j = np.arange(cl.size) - start[g, cl]  # page index within its cluster
        cluster[g, : cl.size] = cl
        row0[g, : cl.size] = first_row[g, cl] + j * page_rows
        length[g, : cl.size] = np.minimum(page_rows, sizes[g, cl] - j * page_rows)
    return PageLayout(key, start, row0, length, cluster, np.full((hkv, n_pages), -1, np.int64))


@dataclass
class Fetched:
    """The pages of a batch of clusters, ordered by (head, cluster): ``head`` / ``cluster`` /
    ``length`` per page (numpy) and ``page``, the pool page to read, or ``-1 - i`` for row ``i``
    of ``extra_k`` / ``extra_v`` ``[n, page_rows, d]`` (pages the pool had no room for in this
    fetch, copied but not kept)."""

    head: np.ndarray
    cluster: np.ndarray
    length: np.ndarray
    page: np.ndarray
    extra_k: torch.Tensor | None = None
    extra_v: torch.Tensor | None = None


@dataclass
class Pages:
    """One request's fetched clusters in one layer, as device pages per KV head: ``k`` / ``v``
    ``[H_kv, P, page_rows, d]``, ``cluster`` / ``length`` ``[H_kv, P]`` (padding pages: length 0)."""

    k: torch.Tensor
    v: torch.Tensor
    cluster: torch.Tensor
    length: torch.Tensor


class PageCache:
    """The device tier: ``capacity_rows // page_rows`` pages of K ``[page_rows, d_k]`` and V
    ``[page_rows, d_v]`` on ``device``, allocated at construction."""

    def __init__(self, host: HostRows, device: torch.device | str, capacity_rows: int, d_k: int, d_v: int,
                 dtype: torch.dtype, page_rows: int = 8) -> None:
        self.host = host
        self.device = torch.device(device)
        self.page_rows = page_rows
        self.n_pages = max(1, capacity_rows // page_rows)
        self.k = torch.zeros(self.n_pages, page_rows, d_k, dtype=dtype, device=self.device)
        self.v = torch.zeros(self.n_pages, page_rows, d_v, dtype=dtype, device=self.device)
        self.page_bytes = page_rows * (d_k + d_v) * self.k.element_size()
        self.layouts: dict[tuple[str, int], PageLayout] = {}
        self.by_id: dict[int, PageLayout] = {}  # the same layouts, by PageLayout.id
        self.next_id = 0
        # per pool page: its owner (layout id, flat index into that layout's pool; -1 = free), CLOCK state
        self.owner_id = np.full(self.n_pages, -1, np.int64)
        self.owner_pos = np.zeros(self.n_pages, np.int64)
        self.free = list(range(self.n_pages - 1, -1, -1))  # a stack: page 0 is taken first
        self.ref = np.zeros(self.n_pages, bool)
        self.stamp = np.full(self.n_pages, -1, np.int64)  # the fetch that last used the page
        self.tick = 0
        self.hand = 0
        self.hits = self.misses = self.evictions = 0

    @property
    def bytes_total(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def pages_used(self) -> int:
        return self.n_pages - len(self.free)

    @property
    def bytes_used(self) -> int:
        return self.pages_used * self.page_bytes

    def register(self, rid: str, layer: int, sizes: torch.Tensor) -> None:
        """Lay out a (request, layer)'s clusters (``sizes`` ``[H_kv, C]``), nothing on the device yet."""
        key = (rid, layer)
        self.drop_layout(key)
        lay = page_layout(key, sizes.cpu().numpy().astype(np.int64), self.page_rows)
        lay.id, self.next_id = self.next_id, self.next_id + 1
        self.layouts[key] = self.by_id[lay.id] = lay

    def fetch(self, rid: str, layer: int, heads: np.ndarray, clusters: np.ndarray) -> Fetched:
        """Every page of clusters ``(heads[i], clusters[i])`` (sorted by head, then cluster), on
        the device: hits are read in place, misses copied from the host tier into pages taken
        from the free list or by CLOCK."""
        lay = self.layouts[(rid, layer)]
        self.tick += 1
        counts = lay.start[heads, clusters + 1] - lay.start[heads, clusters]
        head = np.repeat(heads, counts)
        # virtual page ids: each cluster's run [start, start + count)
        first = np.repeat(lay.start[heads, clusters] - np.cumsum(counts) + counts, counts)
        vpage = first + np.arange(head.size)
        page = lay.pool[head, vpage].copy()
        hit = page >= 0
        self.hits += int(hit.sum())
        self.stamp[page[hit]] = self.tick
        self.ref[page[hit]] = True
        out = Fetched(head, lay.cluster[head, vpage], lay.length[head, vpage], page)
        miss = np.flatnonzero(~hit)
        if miss.size:
            self.misses += int(miss.size)
            self._load(lay, out, miss, vpage[miss])
        return out

    def _load(self, lay: PageLayout, out: Fetched, miss: np.ndarray, vpage: np.ndarray) -> None:
        """Copy the missing pages from the host: one gather of their rows (padding rows read the
        head's row 0 and are masked by ``length``), one copy to the device."""
        e = self.host.layers[lay.key]
        hkv, n_rows = e.k.shape[0], e.k.shape[1]
        head = out.head[miss]
        rows = lay.row0[head, vpage][:, None] + np.arange(self.page_rows)
        rows = np.where(rows < (lay.row0[head, vpage] + lay.length[head, vpage])[:, None], rows, 0)
        flat = torch.from_numpy((head[:, None] * n_rows + rows).reshape(-1))
        k = e.k.reshape(hkv * n_rows, -1)[flat].view(miss.size, self.page_rows, -1).to(self.device, non_blocking=True)
        v = e.v.reshape(hkv * n_rows, -1)[flat].view(miss.size, self.page_rows, -1).to(self.device, non_blocking=True)
        pages = self._take(miss.size)
        kept = pages.size
        if kept:
            t = torch.from_numpy(pages).to(self.device)
            self.k[t] = k[:kept]
            self.v[t] = v[:kept]
            flat_pos = head[:kept] * lay.pool.shape[1] + vpage[:kept]
            lay.pool.reshape(-1)[flat_pos] = pages
            self.owner_id[pages] = lay.id
            self.owner_pos[pages] = flat_pos
            self.stamp[pages] = self.tick
            self.ref[pages] = True
            out.page[miss[:kept]] = pages
        if kept < miss.size:  # the pool is smaller than this fetch: the rest is read from a copy
            out.page[miss[kept:]] = -1 - np.arange(miss.size - kept)
            out.extra_k, out.extra_v = k[kept:], v[kept:]

    def _take(self, n: int) -> np.ndarray:
        """Up to ``n`` pool pages: free ones first, then CLOCK victims (never a page stamped by the
        fetch in progress)."""
        take = [self.free.pop() for _ in range(min(n, len(self.free)))]
        self.stamp[take] = self.tick  # taken pages are this fetch's: never victims of it
        scanned = 0
        while len(take) < n and scanned < 2 * self.n_pages:
            w = min(self.n_pages, max(64, 2 * (n - len(take))))
            cand = (self.hand + np.arange(w)) % self.n_pages
            busy = self.stamp[cand] == self.tick
            ok = np.flatnonzero(~busy & ~self.ref[cand])[: n - len(take)]
            upto = int(ok[-1]) + 1 if len(take) + ok.size == n else w  # the hand stops after the last victim
            passed = cand[:upto]
            self.ref[passed[self.stamp[passed] != self.tick]] = False  # second chance spent
            victims = cand[ok]
            for lid in np.unique(self.owner_id[victims]).tolist():  # each owner forgets its pages
                mine = victims[self.owner_id[victims] == lid]
                self.by_id[lid].pool.reshape(-1)[self.owner_pos[mine]] = -1
            self.owner_id[victims] = -1
            self.stamp[victims] = self.tick
            self.evictions += int(victims.size)
            take.extend(victims.tolist())
            self.hand = (self.hand + upto) % self.n_pages
            scanned += upto
        return np.asarray(take, np.int64)

    def gather(self, f: Fetched, hkv: int) -> Pages:
        """The pages of one fetch on the device, padded to the same count per KV head."""
        counts = np.bincount(f.head, minlength=hkv)
        width = max(1, int(counts.max()))
        pos = np.arange(f.head.size) - (np.cumsum(counts) - counts)[f.head]  # rank within its head
        meta = np.zeros((3, hkv, width), np.int64)
        meta[0, f.head, pos], meta[1, f.head, pos], meta[2, f.head, pos] = f.page, f.cluster, f.length
        page, cluster, length = torch.from_numpy(meta).to(self.device, non_blocking=True)
        k, v = self.k[page.clamp(min=0)], self.v[page.clamp(min=0)]  # [H_kv, P, rows, d]
        if f.extra_k is not None:  # pages the pool had no room for: read from the fetch's copy
            spill = page < 0
            k[spill], v[spill] = f.extra_k[-1 - page[spill]], f.extra_v[-1 - page[spill]]
        return Pages(k, v, cluster, length)

    def drop(self, rid: str) -> None:
        """Forget a request's pages (not counted as evictions)."""
        for key in [key for key in self.layouts if key[0] == rid]:
            self.drop_layout(key)

    def drop_layout(self, key: tuple[str, int]) -> None:
        lay = self.layouts.pop(key, None)
        if lay is None:
            return
        del self.by_id[lay.id]
        pages = lay.pool[lay.pool >= 0]
        self.owner_id[pages] = -1
        self.ref[pages] = False
        self.free.extend(pages.tolist())

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions,
                "page_rows": self.page_rows, "pages_used": self.pages_used, "pages_total": self.n_pages,
                "bytes_used": self.bytes_used, "bytes_total": self.bytes_total}
