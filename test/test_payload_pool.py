"""The pool split of a method with its own KV store (``srt/engine/payload_pool.py``) honours the
user's ``--max-total-tokens`` when the memory allows more: the split is of the capped pool. On an
H200 SGLang sized the pool from memory (710K tokens), the split kept a quarter (177K), and the
user's cap of 196,608 then changed nothing, so the method's store got the memory's bytes."""

from __future__ import annotations

import dataclasses

from sglang_sparse.srt.engine import payload_pool
from sglang_sparse.srt.state import STATE


@dataclasses.dataclass
class _Result:
    max_total_num_tokens: int


class _Configurator:
    _cell_size = 1000  # bytes of one full-precision slot


def _split(monkeypatch, frac):
    monkeypatch.setattr(payload_pool, "_split", lambda: frac)


def test_the_split_is_of_the_users_cap_when_memory_allows_more(monkeypatch):
    _split(monkeypatch, 0.25)
    out = payload_pool._apply(_Configurator(), _Result(710_000), 16, cap=196_608)
    assert out.max_total_num_tokens == 49_152  # a quarter of the cap, page aligned
    assert STATE.scheduler.payload_budget_bytes == (196_608 - 49_152) * 1000  # the rest of the cap's bytes


def test_without_a_cap_or_below_it_the_memory_decides(monkeypatch):
    _split(monkeypatch, 0.25)
    assert payload_pool._apply(_Configurator(), _Result(100_000), 16).max_total_num_tokens == 24_992  # page aligned
    assert STATE.scheduler.payload_budget_bytes == (100_000 - 24_992) * 1000
    out = payload_pool._apply(_Configurator(), _Result(100_000), 16, cap=196_608)  # memory < cap
    assert out.max_total_num_tokens == 24_992


def test_a_method_without_a_store_is_left_alone(monkeypatch):
    _split(monkeypatch, None)
    res = _Result(710_000)
    assert payload_pool._apply(_Configurator(), res, 16, cap=196_608) is res


def test_the_memory_path_reads_the_cap_sglang_was_given(monkeypatch):
    _split(monkeypatch, 0.5)
    monkeypatch.setattr(payload_pool, "_user_cap", lambda: 4096)
    out = payload_pool.around_pool_sizes(lambda conf, avail, page: _Result(50_000), _Configurator(), 10**9, 16)
    assert out.max_total_num_tokens == 2048 and STATE.scheduler.payload_budget_bytes == 2048 * 1000
