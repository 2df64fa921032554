"""Single-request forms of ``sgl_kernel_sparse.reference`` (the one definition of each formula),
so that tests read like the papers' formulas. Nothing here computes a formula of its own."""

from __future__ import annotations

import torch
from sgl_kernel_sparse import reference as R

from sglang_sparse.methods.quest import QuestConfig


def quest_page_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """One decode query ``q [Hq, d]`` against summaries ``[P, Hkv, d]``: ``[Hq, P]``."""
    return R.quest_page_scores(q[None], kmin[None], kmax[None], torch.tensor([kmin.shape[0]]))[0]


def quest_num_pages(budget: int, page: int, n_pages: int) -> int:
    return min(QuestConfig(page_size=page, token_budget=budget).pages_per_head, n_pages)


def quest_select_pages(q, kmin, kmax, budget: int, page: int) -> torch.Tensor:
    """Quest's top pages per query head, ``[Hq, n]`` ascending page ids."""
    scores = quest_page_scores(q, kmin, kmax)
    return R.quest_select_pages(scores[None], quest_num_pages(budget, page, scores.shape[-1]))[0].long()


def masked_decode_attention(q, k, v, mask) -> torch.Tensor:
    """One decode query ``q [Hq, d]`` over the positions ``mask [Hq, T]`` of ``k/v [T, Hkv, d]``."""
    length, hq = k.shape[0], q.shape[0]
    table = torch.arange(length).view(1, length)
    rows = torch.arange(length).expand(1, hq, length)
    return R.sparse_decode_attention(q[None], k, v, table, torch.tensor([0]), rows, mask[None])[0]
