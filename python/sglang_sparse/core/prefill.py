"""Sparse prefill policies (``--sparse-prefill NAME``): engine-agnostic base.

A policy is not a method: it owns no KV and composes with any ``--sparse-method``. In a prefill or
mixed step the controller asks it for a view once the method has none of its own for the layer
(a method whose earlier rows live outside the slot table, per-layer cells or a method store, keeps
its own prefill path); the attention backend then runs the policy's attention for the requests the
view marks and the dense kernel for the rest.
"""

from __future__ import annotations

from collections import Counter

from sglang_sparse.core.events import LayerInput
from sglang_sparse.core.views import BlockSparsePrefillView


class PrefillPolicy:
    name = "none"

    def __init__(self, config) -> None:
        self.config = config
        self.counters: Counter = Counter()

    def view(self, layer: LayerInput) -> BlockSparsePrefillView | None:
        """The view of this layer's step (None: every request dense)."""
        return None
