"""Whether this SGLang process belongs to a server started by ``sglang_sparse.launch_server``.

The launcher puts its configuration, as JSON, into ``SGLANG_SPARSE_CONFIG`` before SGLang spawns
its scheduler and detokenizer; spawned processes inherit the environment, so every process of
the server sees the same configuration. A plain ``python -m sglang.launch_server`` has no such
variable: the plugin then only adds platform support (the CPU fix) and registers nothing else,
which keeps plain SGLang a clean baseline for benchmarks.
"""

from __future__ import annotations

import json
import os

ENV_CONFIG = "SGLANG_SPARSE_CONFIG"


def is_active() -> bool:
    return ENV_CONFIG in os.environ


def load_config() -> dict:
    return json.loads(os.environ.get(ENV_CONFIG) or "{}")


def export_config(config: dict) -> None:
    os.environ[ENV_CONFIG] = json.dumps(config, sort_keys=True)
