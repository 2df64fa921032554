"""Prefix-cache pruning: score a history interval with a probe's attention and pick one keep mask
(engine-agnostic; the paper's section 3.2 "Sparsity-Based Prefix-Cache Pruning", appendix B.2).

A slot holds one token's KV in *every* layer, so physical pruning needs one mask per token: a
token's score is the maximum over layers and query heads of its per-head score, and the mask keeps
the ``keep`` best tokens of the interval(s) (whole pages when the KV is paged).

Policies (``../shared/notes/methods.md``):

- ``snapkv``: the probe is the observation window, the last ``w`` tokens of the sequence,
  recomputed over the cached prefix; per head s_h(j) = sum over window queries i of A^h_ij,
  smoothed along the interval by ``avg_pool1d`` (kernel 7, padding 3, stride 1);
- ``kvzip``: the probe is a "repeat the previous context" prompt followed by the interval's own
  tokens, teacher-forced after the cached sequence (context reconstruction); s_h(j) = max over
  probe queries i of A^h_ij; the first ``KVZIP_SINKS`` positions of the sequence are always kept.

A^h_ij is the softmax attention of probe query i (head h) over every key it sees (causal).
Ties keep the earlier position. The attention, the pooling and SnapKV's window and kernel are the
kernel package's (``sgl_kernel_sparse.reference``), shared with the snapkv method.
"""

from __future__ import annotations

import math

import torch
from sgl_kernel_sparse.reference import KVZIP_SINKS, SNAPKV_KERNEL, pool_positions  # noqa: F401 (KVZIP_SINKS: re-exported)

POLICIES = ("snapkv", "kvzip")
KVZIP_PROMPT = "\n\nRepeat the previous context exactly.\n"
# a later chunk of the served method's chunked probe (methods/kvzip.py): this, then the previous
# chunk's last tokens, then the chunk
KVZIP_PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with "


def kvzip_prompt_ids(encode) -> tuple[list[int], list[int]]:
    """The token ids of KVzip's probe texts (``KVZIP_PROMPT``, ``KVZIP_PART_PROMPT``):
    ``encode(text)`` tokenizes without special tokens. Shared by ``/prune`` (policy kvzip) and
    the served method."""
    return list(encode(KVZIP_PROMPT)), list(encode(KVZIP_PART_PROMPT))


class PruneRequestError(ValueError):
    """Bad input: the message is the sentence the client gets (HTTP 400)."""


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise PruneRequestError(f"unknown policy {policy!r}; use one of {', '.join(POLICIES)}")


def reduce_queries(policy: str, probs: torch.Tensor) -> torch.Tensor:
    """``[Hq, m]`` from ``probs [Hq, s, m]``: summed (snapkv) or maxed (kvzip) over queries.
    Blocks of queries combine with ``combine``."""
    check_policy(policy)
    return probs.sum(dim=1) if policy == "snapkv" else probs.amax(dim=1)


def combine(policy: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b if policy == "snapkv" else torch.maximum(a, b)


def finish_layer(policy: str, per_head: torch.Tensor) -> torch.Tensor:
    """Per-token score ``[m]`` of one layer from ``per_head [Hq, m]`` (interval tokens in
    logical order): snapkv smooths along the interval first; then the max over heads."""
    if policy == "snapkv" and per_head.shape[1] > 1:
        per_head = pool_positions(per_head, SNAPKV_KERNEL)
    return per_head.max(dim=0).values


def layer_scores(policy: str, probs: torch.Tensor) -> torch.Tensor:
    """Per-token score ``[m]`` of one layer from ``probs [Hq, s, m]`` (the probe's attention to
    the interval's retained tokens, in logical order)."""
    return finish_layer(policy, reduce_queries(policy, probs))


def keep_count(total: int, keep_ratio: float | None, keep_tokens: int | None, page: int) -> int:
    """Tokens to keep out of ``total`` retained in the interval(s), rounded down to pages."""
    if (keep_ratio is None) == (keep_tokens is None):
        raise PruneRequestError("give exactly one of keep_ratio (0..1) and keep_tokens (0..interval size)")
    if keep_ratio is not None:
        if not 0.0 <= float(keep_ratio) <= 1.0:
            raise PruneRequestError(f"keep_ratio must be between 0 and 1, got {keep_ratio}")
        keep = int(math.floor(float(keep_ratio) * total))
    else:
        if isinstance(keep_tokens, bool) or not isinstance(keep_tokens, int) or keep_tokens < 0:
            raise PruneRequestError(f"keep_tokens must be a non-negative integer, got {keep_tokens!r}")
        if keep_tokens > total:
            raise PruneRequestError(f"keep_tokens {keep_tokens} is more than the {total} tokens the "
                                    "interval(s) retain")
        keep = keep_tokens
    return keep - keep % page


def keep_mask(scores: torch.Tensor, positions: torch.Tensor, keep: int, page: int = 1,
              always: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask over the interval's retained tokens: the ``keep`` best by score (ties: the
    earlier position), as whole pages (``positions // page``) when ``page > 1``; tokens in
    ``always`` (bool) are kept first and count towards ``keep``."""
    m = scores.numel()
    always = torch.zeros(m, dtype=torch.bool) if always is None else always
    if page == 1:
        unit, unit_score = torch.arange(m), scores.float().clone()
    else:
        unit = torch.unique_consecutive(positions // page, return_inverse=True)[1]
        unit_score = torch.full((int(unit.max()) + 1 if m else 0,), -math.inf)
        unit_score = unit_score.scatter_reduce(0, unit, scores.float(), reduce="amax")
    forced = torch.zeros_like(unit_score, dtype=torch.bool)
    forced[unit[always]] = True
    unit_score = torch.where(forced, torch.full_like(unit_score, math.inf), unit_score)
    n_units = max(0, keep // page)
    # stable sort on (-score): equal scores keep their (positional) order
    order = torch.sort(-unit_score, stable=True).indices[:n_units]
    chosen = torch.zeros_like(unit_score, dtype=torch.bool)
    chosen[order] = True
    return chosen[unit]
