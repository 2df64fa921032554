"""This scheduler's place among SGLang's data-parallel ranks (read from SGLang's runtime context)."""

from __future__ import annotations


def dp_ranks() -> tuple[int, int]:
    """``(rank, ranks)``: this scheduler's data-parallel rank and how many there are."""
    from sglang.srt.runtime_context import get_parallel

    par = get_parallel()
    return int(getattr(par, "dp_rank", None) or 0), int(getattr(par, "num_dp_ranks", None) or 1)


def dp_rank() -> int:
    return dp_ranks()[0]
