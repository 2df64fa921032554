"""The pool SGLang sizes is the method's store: a method with its own KV payload (KIVI's
quantized blocks) gets part of the pool's bytes.

SGLang turns ``--max-total-tokens`` (or what ``--mem-fraction-static`` leaves) into a number of
full-precision slots. For a method whose ``pool_split(config)`` is a fraction f, SGLang keeps
``f`` of those slots (prompts being prefilled, residual windows: what SGLang's allocator and
admission count), and the bytes of the other ``1 - f`` go to the method's own store
(``STATE.scheduler.payload_budget_bytes``, read through ``KVStore.payload_budget_bytes``), so
``kv_bytes_total`` is the bytes SGLang would have given a dense pool.

The user's ``--max-total-tokens`` caps the pool *before* the split. SGLang 0.5.23 sizes the pool
from memory first (``calculate_pool_sizes``, where the split runs) and applies the cap to the
result afterwards, re-sizing from tokens only when the cap is lower. With a cap between the split
slots and the memory's slots (on an H200: 177K kept of 710K, cap 196,608) the cap then changed
nothing, and the method's store got three quarters of the *memory's* bytes, not of the cap's.
"""

from __future__ import annotations

import dataclasses

from sglang_sparse.srt import activation
from sglang_sparse.srt.state import STATE


def _split() -> float | None:
    from sglang_sparse.methods import build_config, get_method

    config = activation.load_config()
    method = config.get("method", "dense")
    return get_method(method).runtime_cls.pool_split(build_config(method, config.get("options")))


def _user_cap() -> int | None:
    from sglang.srt.runtime_context import get_schedule

    return get_schedule().max_total_tokens


def _apply(configurator, result, page_size: int, cap: int | None = None):
    frac = _split()
    total = result.max_total_num_tokens
    if frac is None or not total:
        return result
    if cap:  # the user's --max-total-tokens: split what the user gave, not what memory allows
        total = min(total, cap)
    keep = max(page_size, int(total * frac) // page_size * page_size)
    STATE.scheduler.payload_budget_bytes = (total - keep) * int(configurator._cell_size)
    return dataclasses.replace(result, max_total_num_tokens=keep)


def around_pool_sizes(original, configurator, available_bytes, page_size, *args, **kwargs):
    result = original(configurator, available_bytes, page_size, *args, **kwargs)
    return _apply(configurator, result, page_size, _user_cap())


def around_pool_sizes_from_max_tokens(original, configurator, max_total_num_tokens, page_size, *args, **kwargs):
    result = original(configurator, max_total_num_tokens, page_size, *args, **kwargs)
    return _apply(configurator, result, page_size)
