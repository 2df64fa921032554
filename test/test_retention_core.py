"""The retention map's core (``core/retention.py``, no server): the positions of every form of a
retained map (identity, identity after logical tokens held elsewhere, per head, per layer), runs,
the JSON description, and the layer check."""

from __future__ import annotations

import pytest
import torch

from sglang_sparse.core.retained import RetainedMap
from sglang_sparse.core.retention import (all_positions, check_layers, describe, resident_positions, runs,
                                          with_prefix)


def test_runs_are_half_open_and_cover_exactly_the_positions():
    assert runs(torch.tensor([], dtype=torch.int64)) == []
    assert runs(torch.tensor([7])) == [[7, 8]]
    assert runs(torch.tensor([0, 1, 2, 5, 9, 10])) == [[0, 3], [5, 6], [9, 11]]


def test_identity_and_offset_maps():
    ret = RetainedMap(2, 3)
    ret.append(6)
    assert all(torch.equal(p, torch.arange(6).expand(3, -1)) for p in resident_positions(ret))
    ret.logical_len = 10  # rows stand for logical [4, 10): the first 4 are held elsewhere
    assert resident_positions(ret)[1][2].tolist() == [4, 5, 6, 7, 8, 9]
    assert with_prefix(resident_positions(ret), 4)[0][0].tolist() == list(range(10))
    assert all_positions(ret)[0].shape == (3, 10)


def test_per_head_compaction_then_appended_rows():
    ret = RetainedMap(2, 2)
    ret.append(10)
    ret.keep(torch.tensor([[[0, 1, 5], [2, 3, 9]], [[0, 4, 8], [1, 6, 7]]]))
    ret.append(2)  # positions 10 and 11, in every layer and head
    pos = resident_positions(ret)
    assert pos[0].tolist() == [[0, 1, 5, 10, 11], [2, 3, 9, 10, 11]]
    assert pos[1].tolist() == [[0, 4, 8, 10, 11], [1, 6, 7, 10, 11]]
    d = describe(pos, ret.logical_len, [1], explicit=True)
    assert (d["logical_len"], d["num_layers"], d["kv_heads"], d["kept"]) == (12, 2, 2, 10)
    assert d["kept_fraction"] == round(10 / 24, 6)
    assert d["layers"] == [{"layer": 1, "kept": 10, "heads": [
        {"head": 0, "kept": 5, "ranges": [[0, 1], [4, 5], [8, 9], [10, 12]], "positions": [0, 4, 8, 10, 11]},
        {"head": 1, "kept": 5, "ranges": [[1, 2], [6, 8], [10, 12]], "positions": [1, 6, 7, 10, 11]}]}]


def test_per_layer_maps_keep_one_count_per_layer():
    ret = RetainedMap(2, 1)
    ret.append(8)
    ret.keep_layers([torch.tensor([[0, 3, 7]]), torch.tensor([[6]])], [torch.zeros(3), torch.zeros(1)], 2)
    ret.append(1)
    pos = resident_positions(ret)
    assert [p.tolist() for p in pos] == [[[0, 3, 7, 8]], [[6, 8]]]
    assert [x["kept"] for x in describe(pos, 9, [0, 1])["layers"]] == [4, 2]


def test_layers_are_checked_with_a_sentence():
    assert check_layers(None, 3) == [0, 1, 2]
    assert check_layers([2, 0, 2], 3) == [0, 2]
    for bad in ([3], [-1], [True]):
        with pytest.raises(ValueError, match="out of range; the model has 3 layers"):
            check_layers(bad, 3)
