"""RoPE offsets of rows with logical tokens without KV before them (srt/engine/rows.py).

The positions hook adds ``pos_offset[row]`` to every token's position; while no row holds an
offset it must leave ``forward_batch.positions`` alone (no launch per step for dense or Quest),
and as soon as one row holds one it must shift exactly that row's tokens, in decode and extend.
"""

from types import SimpleNamespace

import pytest
import torch

from sglang_sparse.srt.engine import rows
from sglang_sparse.srt.state import STATE, SchedulerState


class Mode:
    def __init__(self, decode):
        self.decode = decode

    def is_decode(self):
        return self.decode

    def is_extend(self):
        return not self.decode


@pytest.fixture()
def sched(monkeypatch):
    st = SchedulerState()
    st.pos_offset = torch.zeros(8, dtype=torch.int64)
    monkeypatch.setattr(STATE, "scheduler", st)
    return st


def decode_batch(pool_rows, positions):
    return SimpleNamespace(forward_mode=Mode(True), req_pool_indices=torch.tensor(pool_rows),
                           positions=torch.tensor(positions), extend_seq_lens=None)


def test_no_offset_leaves_positions_untouched(sched):
    fb = decode_batch([1, 3], [10, 20])
    before = fb.positions
    rows.before_model_forward(None, fb)
    assert fb.positions is before  # not even a copy: nothing was launched


def test_offset_shifts_only_its_row(sched):
    rows.set_offset(3, 5)
    assert sched.offset_rows == {3}
    fb = decode_batch([1, 3], [10, 20])
    rows.before_model_forward(None, fb)
    assert fb.positions.tolist() == [10, 25]
    # extend: row 3's two tokens shift, row 1's three do not
    fb = SimpleNamespace(forward_mode=Mode(False), req_pool_indices=torch.tensor([1, 3]),
                         positions=torch.tensor([0, 1, 2, 7, 8]), extend_seq_lens=torch.tensor([3, 2]))
    rows.before_model_forward(None, fb)
    assert fb.positions.tolist() == [0, 1, 2, 12, 13]


def test_release_clears_row_and_set(sched):
    rows.set_offset(3, 5)
    rows.set_offset(4, 2)
    rows.set_offset(3, 0)
    assert sched.offset_rows == {4} and sched.pos_offset[3] == 0 and sched.pos_offset[4] == 2
    rows.set_offset(4, 0)
    assert not sched.offset_rows and not sched.pos_offset.any()
    fb = decode_batch([3, 4], [10, 20])
    rows.before_model_forward(None, fb)
    assert fb.positions.tolist() == [10, 20]


def test_on_release_resets_offset(sched):
    req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=6))
    rows.sparse(req).offset = 4
    rows.set_offset(6, 4)
    rows.on_release(req)
    assert not sched.offset_rows and sched.pos_offset[6] == 0 and rows.sparse(req).offset is None
