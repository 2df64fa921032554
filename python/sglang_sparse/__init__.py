"""sglang_sparse: sparse-first KV-cache methods served by the real SGLang runtime.

Layout (see docs/architecture.md):
- ``core``: engine-agnostic pieces (no ``sglang`` import).
- ``srt``: the SGLang adapter (plugin entry point, launcher, hooks); the only code importing ``sglang``.
- ``launch_server``: ``python -m sglang_sparse.launch_server [SGLang flags]``.
"""

__version__ = "0.1.0"

# Every method registers itself on import (registry.py imports none of them).
from sglang_sparse import methods  # noqa: E402,F401
