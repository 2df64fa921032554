"""One allocation for every layer's KV (methods with per-layer rows, e.g. PyramidKV, and
``flat_kv_pool`` methods, H2O and R-KV, whose eviction waves move and score every layer at once).

SGLang allocates one ``[2, slots, H, D]`` tensor per layer (K and V halves). Here the same bytes
come as one ``[2, layers, slots, H, D]`` tensor, and SGLang's ``k_buffer[l]`` / ``v_buffer[l]``
are its views, so every SGLang kernel works unchanged while the store (``engine/kv_store.py``)
can address any layer's part: flat cell ``layer * slots + slot`` (``core/kv_store.py``). Only the
plain token-major layout is supported (the only one SGLang's triton / torch_native backends use);
for any other the original allocation runs: the controller refuses to start a per-layer method,
and a ``flat_kv_pool`` method falls back to one launch per layer (``CacheManager.flat_pool``).
"""

from __future__ import annotations

import torch

from sglang_sparse.srt.state import STATE


def around_create_buffers(original, pool, *args, **kwargs):
    k_shape, v_shape = pool._kv_buffer_shapes()
    plain = (getattr(pool, "kv_cache_layout", "nhd") == "nhd" and not getattr(pool, "use_hnd", False)
             and k_shape == v_shape and not getattr(pool, "enable_custom_mem_pool", False))
    if not plain:
        return original(pool, *args, **kwargs)
    flat = torch.zeros((2, pool.layer_num, *k_shape), dtype=pool.store_dtype, device=pool.device)
    pool.k_buffer = [flat[0, layer] for layer in range(pool.layer_num)]
    pool.v_buffer = [flat[1, layer] for layer in range(pool.layer_num)]
    STATE.scheduler.flat_kv = flat
    return None
