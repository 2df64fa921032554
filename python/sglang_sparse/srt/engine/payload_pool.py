"""The pool SGLang sizes is the method's store: a method with its own KV payload (KIVI's
quantized blocks) gets part of the pool's bytes.

SGLang turns ``--max-total-tokens`` (or what ``--mem-fraction-static`` leaves) into a number of
full-precision slots. For a method whose ``pool_split(config)`` is a fraction f, SGLang keeps
``f`` of those slots (prompts being prefilled, residual windows: what SGLang's allocator and
admission count), and the bytes of the other ``1 - f`` go to the method's own store
(``STATE.scheduler.payload_budget_bytes``, read through ``KVStore.payload_budget_bytes``), so
``kv_bytes_total`` is the bytes SGLang would have given a dense pool.
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


def _apply(configurator, result, page_size: int):
    frac = _split()
    total = result.max_total_num_tokens
    if frac is None or not total:
        return result
    keep = max(page_size, int(total * frac) // page_size * page_size)
    STATE.scheduler.payload_budget_bytes = (total - keep) * int(configurator._cell_size)
    return dataclasses.replace(result, max_total_num_tokens=keep)


def around_pool_sizes(original, configurator, available_bytes, page_size, *args, **kwargs):
    return _apply(configurator, original(configurator, available_bytes, page_size, *args, **kwargs), page_size)


def around_pool_sizes_from_max_tokens(original, configurator, max_total_num_tokens, page_size, *args, **kwargs):
    result = original(configurator, max_total_num_tokens, page_size, *args, **kwargs)
    return _apply(configurator, result, page_size)
