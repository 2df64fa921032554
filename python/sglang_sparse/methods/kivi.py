"""KIVI (Liu et al., ICML 2024): 2- or 4-bit asymmetric KV quantization with a full-precision
residual window.

Keys are quantized per channel over groups of ``group`` tokens, values per token over groups of
``group`` channels (``sgl_kernel_sparse.quant``, codes ``floor((x - min) / s + 0.5)``); the most
recent ``residual`` to ``residual + group - 1`` tokens stay in full precision in the engine's pool.
The quantized history lives in a method-owned block store (``core/quant_store``, one block = G
tokens, fp16 scales and mins).

When (all at the engine's safe point, between steps):
- after the last prompt chunk: every whole group of G tokens older than the residual window is
  quantized into blocks and its rows are released (the prompt is full precision while it is
  prefilled: chunks attend to it exactly);
- while decoding: once the residual holds ``residual + group`` tokens, its oldest G are quantized
  into one block and released (KIVI's streaming rule).
Attention in decode reads the dequantized blocks and the residual in one kernel
(``kernels.quantized.kivi_decode``; Triton dequantizes in registers on CUDA). Decode is
tensor-only (``graph_decode``, inside SGLang's decode CUDA graphs): the block table and the
blocks per engine row (``n_blocks``) are persistent device tensors updated at safe points, and
the residual is the request's resident rows (SGLang's ``seq_lens``).

Memory: the pool SGLang sizes (``--max-total-tokens``, ``--mem-fraction-static``) is split by
bytes (``engine/payload_pool.py``): ``fp_fraction`` of it stays SGLang's full-precision slots
(prompts being prefilled, residual windows: what ``kv_total_slots`` and admission count), the
rest is the block store; ``/sparse/stats`` adds both in bytes. When the block store is full a
request keeps its tokens in full precision (``kivi_store_full`` counts it) and SGLang's own memory
checks apply to its rows. Admission counts blocks (``store_admits``): a request is admitted while
its blocks over its whole life (``(prompt + max_new - residual) // group``) fit next to what the
running requests still need; a request alone in the engine is always admitted (it then falls back
as above rather than waiting for nothing).

Chain Cache: a finished request parks its residual rows (as every evicting method) and its blocks
(``metadata["kivi_blocks"]``, which the chain then owns: ``on_request_parked``, freed by
``release_parked`` when the chain goes). A continuation gets both back, so the history is not
re-quantized; its prefill chunk attends the history's dequantized blocks (``prefix_kv``, plain
torch, once per layer and chunk), then the residual rows, then itself, and after its last chunk
the groups past the residual window are quantized as usual.

Radix cache: the tree keeps a finished request's *blocks* (``prefix_unit = group``: one tree unit
per block, logical ``[j G, (j + 1) G)``), not its residual rows, which are freed as SGLang frees
any row. A later request whose prompt starts with cached whole blocks holds them too (blocks are
refcounted, ``QuantizedBlockStore.ref``), prefills only the rest, and attends the blocks through
``prefix_kv`` as a resumed chain does. Its rows then start at a block boundary, so its own
blocks follow the shared ones. When the store runs short (``plan``, ``store_admits``) the tree's
unlocked blocks are evicted in SGLang's eviction order (``set_units_reclaim``). ``/prune``
answers 409: a quantized prefix has no rows to prune.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.eviction import EvictingRuntime
from sglang_sparse.core.events import DecodeBatch, StepInfo
from sglang_sparse.core.memory_oracle import MemoryOracle
from sglang_sparse.core.quant_store import QuantizedBlockStore
from sglang_sparse.core.retention import resident_positions, with_prefix
from sglang_sparse.core.views import QuantizedDecodeView
from sglang_sparse.registry import ConfigError, check_range, register_method


def check_fp_fraction(value: float) -> None:
    """The share of the pool's bytes that stays full-precision slots (KIVI, TurboQuant)."""
    if not 0.0 < value < 1.0:
        raise ConfigError(f"fp_fraction={value} is out of range: must be in (0, 1), the share "
                          "of the pool's bytes kept as full-precision slots")


@dataclass(frozen=True)
class KIVIConfig:
    bits: int = 2
    group: int = 32
    residual: int = 128
    fp_fraction: float = 0.25

    def validate(self) -> None:
        if self.bits not in (2, 4):
            raise ConfigError(f"bits={self.bits} is not supported: must be 2 or 4")
        check_range("group", self.group, 1, 1024)
        if self.group & (self.group - 1):
            raise ConfigError(f"group={self.group} must be a power of two (the kernel's tile)")
        check_range("residual", self.residual, 1)
        check_fp_fraction(self.fp_fraction)


@register_method("kivi", "quantization", KIVIConfig, "2/4-bit KV (keys per channel, values per token) + fp residual")
class KIVIRuntime(EvictingRuntime):
    graph_decode = True

    @staticmethod
    def pool_split(config: KIVIConfig) -> float:
        return config.fp_fraction

    store_cls = QuantizedBlockStore
    blocks_key = "kivi_blocks"  # request metadata: its blocks, in token order

    def __init__(self, cache, config: KIVIConfig | None = None) -> None:
        self.config = config or KIVIConfig()
        c = self.config
        cap = c.residual + c.group  # full-precision rows a request holds at most (while blocks last)
        super().__init__(cache, MemoryOracle(retained_budget=cap, row_cap=cap))
        k0, store = cache.store.k_buffer(0), cache.store
        self.check_layout(k0)
        per_block = self.block_bytes(store.num_layers, k0.shape[1], k0.shape[2], k0.dtype)
        budget = store.payload_budget_bytes()  # the pool's bytes SGLang left to this store
        if budget is None:  # an engine without the split (the toy engine): as many bytes as its slots
            budget = store.free_count() * store.bytes_per_slot()
        self.blocks = self.make_store(store.num_layers, k0.shape[1], k0.shape[2], max(1, budget // per_block),
                                      k0.device)
        rows, max_len = store.table_shape()
        # block_table[engine row, j]: the j-th block of the request on that row (kernel input)
        self.table = torch.zeros(rows, -(-max_len // c.group), dtype=torch.int32, device=k0.device)
        self.n_blocks = torch.zeros(rows, dtype=torch.int32, device=k0.device)  # blocks per engine row
        # a request's blocks, in token order: metadata[blocks_key] (travels with its chain); a
        # request holds one reference to each (``QuantizedBlockStore.ref``), so do chains and
        # radix nodes sharing them
        self.prefix_unit = c.group

    def check_layout(self, k0: torch.Tensor) -> None:
        c = self.config
        if k0.shape[-1] % c.group:
            raise ConfigError(f"group={c.group} must divide head_dim {k0.shape[-1]}")
        if k0.is_cuda and c.group < 16:
            raise ConfigError(f"group={c.group} is too small for the GPU kernel: must be at least 16 (a tl.dot tile)")

    def make_store(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, device):
        c = self.config
        return QuantizedBlockStore(num_layers, kv_heads, head_dim, num_blocks, c.bits, c.group, device)

    def block_bytes(self, num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        """Bytes of one block of the store (``dtype``: the engine pool's KV dtype)."""
        return self.store_cls.block_bytes(num_layers, kv_heads, head_dim, self.config.bits, self.config.group)

    def write_blocks(self, blocks: list[int], slots: torch.Tensor, start: int) -> None:
        """Move the pool rows at ``slots`` (``len(blocks) * G`` consecutive tokens from logical
        position ``start``) into ``blocks``, every layer."""
        store = self.cache.store
        for layer in range(store.num_layers):
            self.blocks.write(layer, blocks, store.k_buffer(layer)[slots], store.v_buffer(layer)[slots])

    # -- the store -------------------------------------------------------------------------------
    def payload_bytes_per_token(self) -> float:
        return self.blocks.bytes_per_token()

    def payload_bytes(self) -> tuple[int, int]:
        """(total, used) bytes of the block store."""
        per = self.blocks.bytes_per_block()
        return self.blocks.num_blocks * per, (self.blocks.num_blocks - self.blocks.free_count()) * per

    def _blocks_for(self, tokens: int) -> int:
        """Blocks a request of ``tokens`` logical tokens holds at its end (at least ``residual``
        tokens stay full precision)."""
        return max(0, tokens - self.config.residual) // self.config.group

    def store_admits(self, prompt_len: int, max_new_tokens: int, others: list[tuple[str, int, int]],
                     cached: int = 0) -> bool:
        ahead = 0
        for rid, p, n in others:  # blocks the others will still write
            held = len(self._blocks_of(rid)) if rid in self.cache.requests else 0
            ahead += max(0, self._blocks_for(p + n) - held)
        # ``cached``: blocks of its prompt the radix cache holds already (it shares them)
        return self.blocks.make_room(max(0, self._blocks_for(prompt_len + max_new_tokens) - cached) + ahead)

    # -- the radix cache's units: blocks ----------------------------------------------------------
    def cached_units(self, rid: str) -> list[int]:
        return list(self._blocks_of(rid))

    def hold_units(self, units: list[int]) -> None:
        self.blocks.ref(units)

    def drop_units(self, units: list[int]) -> None:
        self.blocks.free(units)

    def units_metadata(self, units: list[int]) -> dict:
        self.blocks.ref(units)
        return {self.blocks_key: list(units)}

    def set_units_reclaim(self, reclaim) -> None:
        self.blocks.reclaim = reclaim

    # -- lifecycle -------------------------------------------------------------------------------
    def _blocks_of(self, rid: str) -> list[int]:
        return self.cache.requests[rid].metadata.get(self.blocks_key, [])

    def on_request_start(self, rid: str) -> None:
        state = self.cache.requests[rid]
        blocks = self._blocks_of(rid)  # a resumed chain's history; [] for a new request
        if blocks:
            self.table[state.req_row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.n_blocks[state.req_row] = len(blocks)  # the row may have served another request

    def on_request_parked(self, rid: str) -> None:
        # the chain's copy of the metadata holds the blocks now; the request keeps none to free
        self.cache.requests[rid].metadata.pop(self.blocks_key, None)

    def on_request_end(self, rid: str) -> None:
        blocks = self._blocks_of(rid)
        self.n_blocks[self.cache.requests[rid].req_row] = 0
        if blocks:
            self.blocks.free(blocks)

    def release_parked(self, metadata: dict) -> None:
        if metadata.get(self.blocks_key):
            self.blocks.free(metadata[self.blocks_key])

    def kept_positions(self, retained, metadata: dict) -> list[torch.Tensor]:
        """The resident rows (the full-precision residual) plus logical ``[0, blocks * group)``,
        which the quantized blocks hold (kept, at ``bits`` bits)."""
        prefix = len(metadata.get(self.blocks_key, [])) * self.config.group
        return with_prefix(resident_positions(retained), prefix)

    def prefix_kv(self, rid: str, layer_id: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A resumed chain's quantized history, dequantized for its prefill chunks (a new
        request's prompt has no blocks while it is prefilled)."""
        blocks = self._blocks_of(rid)
        return self.blocks.read(layer_id, blocks) if blocks else None

    def finish_step(self, step: StepInfo) -> None:
        c = self.config
        for r in step.requests:
            state = self.cache.requests.get(r.rid)
            if state is None or r.logical_end < r.prompt_len:
                continue
            if state.retained.n_rows >= c.residual + c.group:
                self.schedule(r.rid)

    def plan(self, rid: str) -> torch.Tensor | None:
        """Quantize the oldest whole groups beyond the residual window into new blocks; the rows
        that stay are the newest ones (positions kept, per layer and head)."""
        c = self.config
        state = self.cache.requests[rid]
        ret = state.retained
        n_groups = (ret.n_rows - c.residual) // c.group
        if n_groups <= 0:
            return None
        blocks = self.blocks.alloc(n_groups)
        if blocks is None:
            self.bump(f"{self.name}_store_full")
            return None
        slots = self.cache.resident_slots(rid)[: n_groups * c.group].to(self.table.device)
        mine = state.metadata.get(self.blocks_key, [])
        self.write_blocks(blocks, slots, len(mine) * c.group)
        self.table[state.req_row, len(mine): len(mine) + n_groups] = torch.tensor(blocks, dtype=torch.int32)
        mine = state.metadata[self.blocks_key] = mine + blocks  # a new list: a parked copy keeps its own
        self.n_blocks[state.req_row] = len(mine)
        self.bump(f"{self.name}_blocks_written", n_groups)
        held = ret.token_positions()  # KIVI's maps are token-uniform: rows re-pointed, no KV moved
        if held is None:
            held = ret.all_positions()
        return held[..., n_groups * c.group:]  # the residual: every layer and head alike

    # -- decode (tensor-only: also captured into CUDA graphs) ----------------------------------
    def decode_view_tensors(self, batch: DecodeBatch) -> QuantizedDecodeView:
        return QuantizedDecodeView(self.blocks, self.table, self.n_blocks.index_select(0, batch.req_rows.long()))
