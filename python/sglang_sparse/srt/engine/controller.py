"""Build this scheduler's SparseController from the configuration the launcher exported."""

from __future__ import annotations

import logging

import torch

from sglang_sparse.core.cache_manager import CacheManager
from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.runtime import ModelRope
from sglang_sparse.core.tensor_parallel import HeadShards
from sglang_sparse.methods import build_config, get_method
from sglang_sparse.registry import build_prefill_config, get_prefill
from sglang_sparse.srt import activation
from sglang_sparse.srt.chains import scheduler as chains
from sglang_sparse.srt.engine.kv_store import SGLangKVStore
from sglang_sparse.srt.engine.model_rope import model_rope
from sglang_sparse.srt.state import STATE

logger = logging.getLogger("sglang_sparse")


def ensure_controller(model_runner) -> SparseController:
    st = STATE.scheduler
    if st.controller is None:
        config = activation.load_config()
        method = config.get("method", "dense")
        spec = get_method(method)
        pool = model_runner.token_to_kv_pool
        if spec.runtime_cls.per_layer_rows and getattr(pool, "store_dtype", pool.dtype) != pool.dtype:
            # e.g. an fp8 checkpoint with --kv-cache-dtype auto: SGLang keeps fp8 KV as uint8 bytes, which
            # the per-layer cells kernels would read as numbers (the launcher refuses the explicit flag)
            raise RuntimeError(f"--sparse-method {method} compacts per layer and reads the KV cache as "
                               f"{pool.store_dtype}, but this model's KV cache is {pool.dtype} (an fp8 checkpoint "
                               "resolves --kv-cache-dtype auto to fp8): pass --kv-cache-dtype bfloat16")
        if spec.runtime_cls.per_layer_rows and st.flat_kv is None:
            raise RuntimeError(f"--sparse-method {method} compacts per layer and needs SGLang's plain token-major "
                               "KV layout (one allocation for all layers, engine/flat_pool.py)")
        store = SGLangKVStore(model_runner)
        kv_heads = model_runner.token_to_kv_pool.head_num
        cache = CacheManager(store, kv_heads, tp_heads(model_runner))
        runtime = spec.runtime_cls(cache, build_config(method, config.get("options")))
        if runtime.projects_kv:
            if st.model_info is None:
                raise RuntimeError(f"--sparse-method {method} projects K/V but its model hook did not run "
                                   "(engine/projection.py)")
            runtime.bind_model(st.model_info)
        if runtime.reads_rope:  # the model is loaded (the scheduler builds the controller after it)
            runtime.bind_model(ModelRope(model_rope(model_runner), config.get("artifacts") or {}))
        if runtime.reads_tokens:
            texts = token_texts(model_runner)
            if texts is not None:
                runtime.use_vocabulary(texts)
        st.controller = SparseController(runtime, prefill_policy(config))
        # RoPE offsets of rows with logical tokens before them that hold no KV (evicted, or pruned
        # out of a radix path): any method can meet the latter (engine/rows.py).
        rows = model_runner.req_to_token_pool.req_to_token.shape[0]
        st.pos_offset = torch.zeros(rows, dtype=torch.int64, device=model_runner.device)
        chains.setup(model_runner, config)
        logger.info("sglang_sparse: method %s %s, chain cache %s, sparse prefill %s", method, config.get("options"),
                    "on" if st.chains is not None else "off", config.get("prefill") or "none")
    return st.controller


def tp_heads(model_runner) -> HeadShards | None:
    """This rank's share of the KV heads under ``--tp-size`` > 1 (None: one rank holds all)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size <= 1:
        return None
    return HeadShards(group.cpu_group, group.device_group)


def prefill_policy(config: dict):
    """The ``--sparse-prefill`` policy of the launcher's configuration (None: dense prefill)."""
    prefill = config.get("prefill")
    if not prefill:
        return None
    spec = get_prefill(prefill["name"])
    return spec.policy_cls(build_prefill_config(prefill["name"], prefill.get("options")))


def token_texts(model_runner) -> list[str] | None:
    """The decoded text of every token id, from the server's tokenizer (the one SGLang's
    tokenizer manager loads: ``--tokenizer-path``, else the model's directory); None when it
    cannot be loaded (the method then sees no token text)."""
    from transformers import AutoTokenizer

    args = model_runner.server_args
    path = getattr(args, "tokenizer_path", None) or args.model_path
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=bool(getattr(args, "trust_remote_code", False)))
    except Exception as err:  # noqa: BLE001 - any loader failure: run without token text
        logger.warning("sglang_sparse: no tokenizer at %s (%s): the method sees no token text", path, err)
        return None
    return tok.batch_decode([[i] for i in range(len(tok))])
