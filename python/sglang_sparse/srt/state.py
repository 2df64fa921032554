"""Per-process sglang_sparse state in the scheduler process: the controller and the current step.

One scheduler (one model runner) per process, so a module-level holder is enough; it is created
by the attention backend when SGLang builds it (after the KV pool exists).
"""

from __future__ import annotations

import torch

from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.events import StepInfo

controller: SparseController | None = None
current_step: StepInfo | None = None
# Per request row: logical length minus resident rows (tokens whose KV was evicted). Decode RoPE
# positions are ``seq_lens - 1 + pos_offset[row]`` (SGLang's seq_lens counts resident rows).
pos_offset: torch.Tensor | None = None
# Chain Cache (srt/chains.py): the index of this scheduler's chains, and what a chain must match.
chains = None
chain_fingerprint: str = ""

# Prefix-cache pruning (srt/prune.py): planned jobs by id, and the req_to_token rows of running
# probe requests (the attention backend sees rows, not requests).
prune_jobs: dict = {}
probe_rows: dict = {}

# Slot-census failures seen by the every-step check (srt/integrity.py).
integrity_violations: int = 0
