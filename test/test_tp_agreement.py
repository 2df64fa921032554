"""Tensor-parallel agreement (issue 18): two ranks of a gloo process group each hold half of the
KV heads, as ``--tp-size 2`` splits them, and run the same request through the toy engine.
Every rank must keep, per KV head, exactly what the single-process run keeps for that head, and
free the same slots at the same steps: per-head choices (SnapKV, PyramidKV, H2O, R-KV, Quest's
pages, RetroInfer's clusters, KIVI's and TurboQuant's blocks) need no communication; choices across heads (SkipKV's segments, KVzip's
global ratio, OmniKV's ``max_h`` rows, ``/prune``'s mask) gather every rank's heads
(``core.tensor_parallel``). Compression methods (Palu, DeltaKV) refuse ``--tp-size`` > 1
(their launcher tests)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

import tp_ranks
from sglang_sparse.core.tensor_parallel import SingleRank
from toy_engine import HKV, HQ

SIZE = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    mp.spawn(tp_ranks.rank_main, args=(SIZE, str(out / "init"), str(out)), nprocs=SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt") for r in range(SIZE)]


@pytest.mark.parametrize("name", list(tp_ranks.CASES))
def test_each_rank_keeps_what_one_process_keeps_for_its_heads(ranks, name):
    want = tp_ranks.run_case(name, SingleRank())
    kv_per, q_per = HKV // SIZE, HQ // SIZE
    for r, got in enumerate(rank[name] for rank in ranks):
        # the same slots freed at the same steps, the same rows held: identical accounting
        for key in ("freed", "free", "rows", "logical", "blocks_free"):
            assert got.get(key) == want.get(key), (name, r, key, got.get(key), want.get(key))
        assert got["free_after"] == got["free0"]  # every slot back
        for layer, (a, b) in enumerate(zip(got["positions"], want["positions"])):
            assert torch.equal(a, b[r * kv_per: (r + 1) * kv_per]), (name, r, layer, a, b)
        assert len(got["views"]) == len(want["views"])
        for step_got, step_want in zip(got["views"], want["views"]):
            assert [x[:2] for x in step_got] == [x[:2] for x in step_want]
            for (_, kind, a), (_, _, b) in zip(step_got, step_want):
                if kind in ("page_ids", "out"):  # per query head: this rank's query heads
                    b = b[:, r * q_per: (r + 1) * q_per]
                if kind == "out":  # attention outputs: the same clusters read, fp32 rounding apart
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
                else:
                    assert torch.equal(a, b), (name, r, kind)
    assert ranks[0][name]["counters"] == ranks[1][name]["counters"]


def test_the_prune_mask_is_the_same_on_every_rank_and_equals_one_process(ranks):
    want = tp_ranks.prune_mask(SingleRank())
    assert int(want.sum()) == 12
    for rank in ranks:
        assert torch.equal(rank["prune"], want)


def test_cross_head_cases_differ_between_ranks_without_the_gather():
    """The cases are sensitive: each rank choosing from its own heads alone keeps other tokens
    (KVzip, SkipKV: and frees a different number of slots, which would set the ranks' schedulers
    apart), reads other rows (OmniKV) or prunes another mask."""
    alone = [tp_ranks.run_case("skipkv", _Alone(r), r, SIZE) for r in range(SIZE)]
    assert alone[0]["freed"] != alone[1]["freed"]
    alone = [tp_ranks.run_case("kvzip", _Alone(r), r, SIZE) for r in range(SIZE)]
    assert alone[0]["freed"] != tp_ranks.run_case("kvzip", SingleRank())["freed"]
    assert not all(torch.equal(a, b) for a, b in zip(alone[0]["positions"], alone[1]["positions"]))
    alone = [tp_ranks.run_case("omnikv", _Alone(r), r, SIZE) for r in range(SIZE)]
    assert not all(torch.equal(a[2], b[2]) for s0, s1 in zip(alone[0]["views"], alone[1]["views"])
                   for a, b in zip(s0, s1))
    masks = [tp_ranks.prune_mask(_Alone(r), r, SIZE) for r in range(SIZE)]
    assert not torch.equal(masks[0], masks[1])


class _Alone(SingleRank):
    """A rank that never talks to the other: its own heads only."""

    def __init__(self, rank: int) -> None:
        self.rank, self.size = rank, SIZE
