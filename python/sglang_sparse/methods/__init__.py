"""Sparse methods, one file each; importing this package registers them all (``registry``)."""

from sglang_sparse.methods import (deltakv, dense, flashprefill, fp8, h2o, kivi, kvzip, omnikv, palu,  # noqa: F401
                                   pyramidkv, quest, retroinfer, rkv, skipkv, snapkv, streamingllm, turboquant)
from sglang_sparse.registry import build_config, get_method, method_names  # noqa: F401
