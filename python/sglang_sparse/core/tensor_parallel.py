"""Tensor parallelism: the KV heads a rank holds, and the few decisions that need all of them
(engine-agnostic: torch.distributed only).

Under ``--tp-size N`` each rank holds ``kv_heads / N`` KV heads (SGLang splits them evenly, in
order: rank r holds global heads ``[r * h, (r + 1) * h)``) and runs the same scheduler on the
same requests. A method's per-KV-head choices (SnapKV / H2O / R-KV / PyramidKV top-k, Quest's
pages, RetroInfer's clusters) stay local: every rank keeps the same *number* of rows per head,
so slot accounting is identical without talking. A choice that spans heads must see all of
them, or ranks would keep different tokens and free different slot counts, and their schedulers
would drift apart. Those go through ``HeadShards``:

- ``gather(t, dim)``: every rank's heads, concatenated in global head order (SkipKV's segment
  scores, KVzip's global keep ratio, then ``local`` takes this rank's share back);
- ``max_(t)``: element-wise maximum over ranks, in place (OmniKV's ``max_h`` score, ``/prune``'s
  per-token score: a maximum over heads is the maximum of the ranks' maxima).

Inputs are identical on every rank (the same requests, weights and kernels), so a decision made
from gathered scores is the same on every rank. ``SingleRank`` (the default) does no collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SingleRank:
    """One rank holds every head: gathers and reductions are the identity."""

    size = 1
    rank = 0

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_object(self, obj) -> list:
        return [obj]


class HeadShards(SingleRank):
    """The heads of one rank of a tensor-parallel group. ``group``: the process group that
    carries host tensors (gloo; SGLang's ``tp_group.cpu_group``); ``device_group`` carries device
    tensors (NCCL on CUDA; the same group on the CPU)."""

    def __init__(self, group, device_group=None) -> None:
        self.group = group
        self.device_group = device_group if device_group is not None else group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def _group_of(self, t: torch.Tensor):
        return self.group if t.device.type == "cpu" else self.device_group

    def gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t.contiguous(), group=self._group_of(t))
        return torch.cat(parts, dim=dim)

    def local(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of a tensor over all heads (``gather``'s inverse)."""
        per = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * per, per)

    def max_(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group_of(t))
        return t

    def gather_object(self, obj) -> list:
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out
