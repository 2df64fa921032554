"""Platform support: what SGLang 0.5.23 needs to serve on a CPU.

SGLang's rotary embedding picks a compiled kernel (``vllm._custom_ops``) unless the process looks
like a non-CUDA device; on a CPU-only machine the scheduler dies importing it. Marking the module
as MPS selects its plain-torch path. It must happen in every process (the scheduler is spawned
and re-imports SGLang), which is why it lives in the plugin.
"""

from __future__ import annotations

import sys


def cpu_requested(argv: list[str] | None = None) -> bool:
    """True when ``--device cpu`` is on the command line or no CUDA device is visible."""
    argv = sys.argv if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1] == "cpu"
        if arg.startswith("--device="):
            return arg.split("=", 1)[1] == "cpu"
    import torch

    return not torch.cuda.is_available()


def enable_cpu() -> None:
    import sglang.srt.layers.rotary_embedding.base as rope_base

    rope_base._is_mps = True
