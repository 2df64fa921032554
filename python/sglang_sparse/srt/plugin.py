"""The sglang_sparse plugin: entry point ``sglang_sparse`` in group ``sglang.srt.plugins``.

SGLang calls ``load()`` early in every process it starts (launcher, scheduler, detokenizer,
DP controller, offline Engine); ``HookRegistry.apply_hooks()`` runs right after all plugins.
``load`` applies the entries of ``inventory.PATCHES`` whose process and condition hold here, and
is the only caller of SGLang's registration functions (``HookRegistry.register``,
``register_attention_backend``, ``add_attention_backend_choices``,
``register_radix_cache_backend``, ``add_api_route``, ``add_exception_handler``;
``test/test_import_rule.py`` checks it). Plain ``python -m sglang.launch_server`` gets only the
CPU fix.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os

from sglang_sparse.srt import activation, platform
from sglang_sparse.srt.inventory import CALLED_KINDS, HOOK_KINDS, LISTED_KINDS, PATCHES, Patch
from sglang_sparse.srt.state import STATE

logger = logging.getLogger("sglang_sparse")


def load() -> None:
    if STATE.loaded:  # SGLang guards too; this keeps direct calls idempotent.
        return
    STATE.loaded = True
    process = "main" if multiprocessing.current_process().name == "MainProcess" else "scheduler"
    conditions = _conditions()
    for patch in PATCHES:
        if patch.process in ("all", process) and conditions[patch.when]:
            _apply(patch)
            STATE.applied.append(patch)
    if conditions["active"]:
        logger.info("sglang_sparse plugin loaded: %s", ", ".join(p.name for p in STATE.applied))


def _conditions() -> dict[str, bool]:
    active = activation.is_active()
    config = activation.load_config() if active else {}
    evicting = per_layer = flat = payload = probe = projects = False
    if active:
        from sglang_sparse.methods import build_config, get_method

        method = config.get("method", "dense")
        runtime = get_method(method).runtime_cls
        evicting, per_layer, probe = runtime.evicts_kv, runtime.per_layer_rows, runtime.needs_engine_probe
        projects, flat = runtime.projects_kv, runtime.flat_kv_pool
        payload = runtime.pool_split(build_config(method, config.get("options"))) is not None
    return {"cpu": platform.cpu_requested(), "active": active, "evicting": active and evicting,
            "flat_kv_pool": active and (per_layer or flat), "payload_pool": active and payload,
            "chain_cache": active and bool(config.get("chain_cache")),
            "engine_probe": active and probe, "projects_kv": active and projects,
            "check_integrity": active and os.environ.get("SGLANG_SPARSE_CHECK_INTEGRITY", "") not in ("", "0")}


def handler_of(patch: Patch):
    module, attr = patch.handler.split(":")
    return getattr(importlib.import_module(f"sglang_sparse.srt.{module}"), attr)


def _apply(patch: Patch) -> None:
    if patch.kind in LISTED_KINDS:
        return  # done inside the handler of ``patch.applied_by``
    handler = handler_of(patch)
    if patch.kind in HOOK_KINDS:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(patch.target, handler, HookType[patch.kind.upper()])
    elif patch.kind in CALLED_KINDS:
        handler()
    elif patch.kind == "attention-backend":  # SGLang's own names: its CLI choices already have them
        from sglang.srt.layers.attention.attention_registry import register_attention_backend

        register_attention_backend(patch.target)(handler)
    elif patch.kind == "radix-backend":
        from sglang.srt.mem_cache import registry

        try:
            registry.register_radix_cache_backend(patch.target, handler)
        except ValueError:  # already registered in this process
            pass
    elif patch.kind == "route":
        from sglang.srt.entrypoints.http_server import app

        app.add_api_route(patch.target, handler, methods=list(patch.methods))
    elif patch.kind == "exception-handler":
        from sglang.srt.entrypoints.http_server import app

        exc = getattr(importlib.import_module(patch.target.rsplit(".", 1)[0]), patch.target.rsplit(".", 1)[1])
        app.add_exception_handler(exc, handler(app.exception_handlers.get(exc)))
    else:
        raise ValueError(f"inventory entry {patch.name}: unknown kind {patch.kind!r}")
