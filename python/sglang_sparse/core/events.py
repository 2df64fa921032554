"""Typed, immutable events handed to a method's lifecycle hooks (engine-agnostic).

Index conventions used everywhere in sglang_sparse:
- *logical* position: the token's index in the request's full token sequence (prompt + output).
  Drives RoPE positions, prefix matching, chain digests.
- *row*: the index into the request's slot table (``req_to_token[req_row, row]`` in SGLang).
  Rows ``[0, n_rows)`` hold the request's resident KV. Without eviction row == logical position;
  after compaction, row ``i`` of layer ``l`` / KV head ``h`` holds the logical position
  ``RetainedMap.positions[l, h, i]``.
- All ranges are half-open ``[start, end)``.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass

import torch


class StepMode(enum.Enum):
    PREFILL = "prefill"  # every request extends (a prompt chunk, possibly after a cached prefix)
    DECODE = "decode"  # every request adds exactly one token
    MIXED = "mixed"  # prefill chunks and decode tokens in one forward
    IDLE = "idle"


@dataclass(frozen=True)
class RequestSlice:
    """One request's share of a forward step.

    ``[logical_start, logical_end)`` are the logical positions computed in this step and
    ``[row_start, row_start + (logical_end - logical_start))`` the rows their KV is written to.
    ``token_ids``: the token ids of those logical positions, filled only for a runtime that
    ``reads_tokens`` (empty otherwise).
    """

    rid: str
    req_row: int  # the request's row in the engine's slot table
    logical_start: int
    logical_end: int
    row_start: int
    prompt_len: int
    token_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.logical_end - self.logical_start

    @property
    def is_prefill(self) -> bool:
        return self.logical_start < self.prompt_len

    @property
    def is_last_prompt_chunk(self) -> bool:
        """True for the chunk that completes the prompt (fires once per request)."""
        return self.is_prefill and self.logical_end >= self.prompt_len


@dataclass(frozen=True)
class StepInfo:
    """One forward pass. ``token_offsets[i]`` is where request i's tokens start in the flattened
    per-step tensors (q, k, v of shape ``[num_tokens, heads, head_dim]``)."""

    step_id: int
    mode: StepMode
    requests: tuple[RequestSlice, ...]

    @functools.cached_property  # read per request per layer; the step never changes
    def token_offsets(self) -> tuple[int, ...]:
        offsets, acc = [], 0
        for r in self.requests:
            offsets.append(acc)
            acc += r.num_tokens
        return tuple(offsets)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True)
class LayerInput:
    """What attention sees in one layer of one step: post-RoPE ``q`` ``[T, H_q, d]``, ``k`` and
    ``v`` ``[T, H_kv, d]`` for the step's T tokens (flattened over requests, see StepInfo)."""

    layer_id: int
    step: StepInfo
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def request_tokens(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        start = self.step.token_offsets[index]
        return tensor[start : start + self.step.requests[index].num_tokens]


@dataclass(frozen=True)
class DecodeBatch:
    """Tensor-only input of one decode layer, for methods whose decode selection runs inside a
    CUDA graph (``SparseMethodRuntime.graph_decode``): no Python per-request state, no host sync.

    ``q`` ``[B, H_q, d]`` (this step's queries, post-RoPE), ``k`` ``[B, H_kv, d]`` (this step's
    keys, already written to ``slots``), ``req_rows`` ``[B]`` rows of ``table`` (the engine's slot
    table ``[R, max_len]``), ``n_rows`` ``[B]`` resident rows incl. this token (its row is
    ``n_rows - 1``), ``slots`` ``[B]`` where this token's KV was written, ``k_cache`` / ``v_cache``
    ``[num_slots, H_kv, d]`` this layer's pool. In a captured graph B is the padded batch size:
    padding entries carry the engine's filler values and their outputs are discarded.
    """

    layer_id: int
    q: torch.Tensor
    k: torch.Tensor
    req_rows: torch.Tensor
    n_rows: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
