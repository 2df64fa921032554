"""Dense: full attention, full KV. The pass-through method; every hook keeps its default."""

from __future__ import annotations

from dataclasses import dataclass

from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.registry import register_method


@dataclass(frozen=True)
class DenseConfig:
    def validate(self) -> None:
        pass


@register_method("dense", "none", DenseConfig, "full attention over the full KV cache")
class DenseRuntime(SparseMethodRuntime):
    changes_attention = False

    def __init__(self, cache, config: DenseConfig | None = None) -> None:
        super().__init__(cache)
        self.config = config or DenseConfig()
