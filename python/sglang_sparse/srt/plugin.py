"""The sglang_sparse plugin: entry point ``sglang_sparse`` in group ``sglang.srt.plugins``.

SGLang calls ``load()`` early in every process it starts (launcher, scheduler, detokenizer,
DP controller, offline Engine); ``HookRegistry.apply_hooks()`` runs right after all plugins.
This is the single place where sglang_sparse registers itself with SGLang.

- Always: platform support (the CPU fix), also for plain ``python -m sglang.launch_server``.
- Only in servers started by ``sglang_sparse.launch_server`` (see ``activation``): everything
  else: status hooks and admin routes now; attention backend, model-runner / KV-pool hooks and
  radix-cache backend as later capabilities land.
"""

from __future__ import annotations

import logging
import multiprocessing

from sglang_sparse.srt import activation, platform, status

logger = logging.getLogger("sglang_sparse")

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:  # SGLang guards too; this keeps direct calls idempotent.
        return
    _loaded = True
    if platform.cpu_requested():
        platform.enable_cpu()
        status.REGISTRATIONS.append("platform:cpu-rotary-plain-torch")
    if not activation.is_active():
        return
    status.register_scheduler_status()
    status.REGISTRATIONS.append("hook:scheduler-internal-state")
    status.register_routes()
    chain_cache = bool(activation.load_config().get("chain_cache"))
    if multiprocessing.current_process().name != "MainProcess":
        _register_runtime(chain_cache)
    else:
        _register_main(chain_cache)
    logger.info("sglang_sparse plugin loaded: %s", ", ".join(status.REGISTRATIONS))


def _register_main(chain_cache: bool) -> None:
    """HTTP side: request checks before SGLang takes a request, chain fields in responses."""
    from sglang_sparse.srt import request_guard

    status.REGISTRATIONS.extend(request_guard.register())
    if chain_cache:
        from sglang_sparse.srt import chains

        status.REGISTRATIONS.extend(chains.register_main())


def _register_runtime(chain_cache: bool) -> None:
    """Scheduler-side: the attention backend that drives the controller, the step hooks, the
    MemoryOracle-driven admission and (when on) Chain Cache."""
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from sglang_sparse.srt import admission, attention, integrity, metrics, prune, radix, step_hooks

    register_attention_backend("torch_native")(attention.create_backend)
    register_attention_backend("triton")(_create_triton_backend)
    status.REGISTRATIONS.extend(["attention-backend:torch_native", "attention-backend:triton"])
    status.REGISTRATIONS.extend(step_hooks.register())
    status.REGISTRATIONS.extend(admission.register())
    status.REGISTRATIONS.extend(radix.register())
    status.REGISTRATIONS.extend(prune.register())
    status.REGISTRATIONS.extend(integrity.register())
    status.REGISTRATIONS.extend(metrics.register_scheduler())
    if chain_cache:
        from sglang_sparse.srt import chains

        status.REGISTRATIONS.extend(chains.register_scheduler())


def _create_triton_backend(model_runner):
    from sglang_sparse.srt import attention_triton  # loads SGLang's Triton backend: CUDA only

    return attention_triton.create_backend(model_runner)
