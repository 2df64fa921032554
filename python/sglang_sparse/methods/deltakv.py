"""DeltaKV (arXiv 2602.08005; the SparseEngine paper's compression family): residual coding of
the KV history against similar earlier tokens. Standalone DeltaKV (the whole history is
reconstructed for attention) on KIVI's machinery (``methods/kivi.py`` holds the details of the
pool split, admission by blocks, Chain Cache, the radix cache of blocks and ``/prune`` 409).

**The compressor is not the paper's.** DeltaKV trains ``down`` / ``up`` on the frozen LLM with a
reconstruction + next-token loss; its checkpoints exist for Qwen2.5-7B-1M, Qwen3-4B and
Llama-3.1-8B only, there is no hub access here, and training one for the default model
(SmolLM2-135M) is out of scope. This method uses a linear compressor *fitted by the project*
(``core/delta_fit.py``): the centred PCA of the residuals, i.e. the linear autoencoder that
minimises the reconstruction MSE of K|V, not the model's loss. At equal latent size the
directions attention depends on are served worse than by a trained compressor, so quality is
expected below the paper's; figures measured here describe this compressor on SmolLM2, not
DeltaKV's published accuracy.

The mechanism (formulas: ``sgl_kernel_sparse.deltakv``; store: ``core/delta_store.py``):

- a token's vector is its pre-RoPE K|V, every KV head of the layer (``W = 2 H d``); RoPE is applied
  after reconstruction, at the token's logical position;
- the newest ``residual`` to ``residual + group - 1`` tokens stay full precision in SGLang's pool
  (the paper's recent tail); older tokens move, in blocks of ``group`` tokens, into the block
  store at the safe point (after the prompt's last chunk, then whenever the residual reaches
  ``residual + group``); the rows are un-rotated with the model's RoPE table
  (``srt/engine/model_rope.py``) when they move;
- references: the tokens at block offsets ``o % stride == 0`` (every ``stride``-th token of the
  request), stored exact in the pool's dtype; position 0 (the attention sink) is always one;
- fathers of a token: the ``neighbors`` references at positions <= its own with the highest
  similarity of K (``metric``: l2 (default) as ``2 a.b - |b|^2``, dot or cosine), found among the
  request's earlier references and the new blocks' own; stored as request-level reference
  ordinals (int32), so a block only points into its own prefix of blocks (valid for radix-shared
  and chain-resumed prefixes); ties go to the lower ordinal, missing fathers are -1;
- ``base`` = mean of the fathers' vectors; code ``c = down(kv) - down(base)`` (``latent`` numbers,
  the pool's dtype); read: ``kv^ = up(c) + base`` with ``up`` linear with bias.

Choices the paper leaves open or this version changes (each one stated):

- no separate sink window (a fixed-shape block cannot hold a variable one): the paper keeps 64
  sinks; here position 0 and every ``stride``-th token are exact;
- every layer is compressed (no ``full_attn_layers``), no OmniKV token selection, no growing
  reference stride (``stride_alpha``), no 4-bit codes;
- the fit: per layer, residuals of ``8 x 1024`` held-out essay tokens (from token 40,000; the
  same reference rule, references excluded) from HF transformers in fp32; cached as
  ``<model>/sglang_sparse/deltakv-<key>.safetensors`` (``delta_artifacts.py``; the full basis:
  every latent size is a prefix). ``latent`` may be the full width (exact reconstruction);
- codes and references keep the pool's dtype (fp16 / bf16 serving: ``layers * (latent * 2 +
  neighbors * 4 + W * 2 / stride)`` B per token, 5,760 on the default model at the defaults:
  a quarter of its 23,040; fp32 serving doubles the 16-bit parts);
- a reference's own code and fathers are stored (fixed block shape) but never read;
- decode reconstructs each request's blocks in plain torch every step (``kernels.quantized.
  deltakv_decode``), so ``decode_kernel_graph_safe = False`` (``--disable-cuda-graph`` on a GPU;
  no GPU kernel, not run on a GPU).

Measured on the default model (SmolLM2-135M), 1,024 held-out essay tokens through HF transformers,
relative L2 error of the reconstructed pre-RoPE K / V, mean over layers
(``test_deltakv_core.py::test_error_on_held_out_text_of_the_default_model``): 0.19 / 0.60 at the
defaults, 0.26 / 0.76 at stride 32, latent 32. The PCA of K|V together favours K (the larger
channels on this model); V keeps little of its residual.

Perplexity (``benchmark/bench_ppl.py``, held-out essays over a 1,536-token context resumed from
the chain's blocks): dense 24.41, defaults 25.57 (1.048x), stride 32 / latent 32 26.97 (1.105x).

DeltaKV does not change the model's projections (unlike Palu): every token is computed by the
model as dense; only the stored history is approximated.

Counters (``/sparse/stats``): ``deltakv_blocks_written``, ``deltakv_store_full``;
``method_static_bytes`` is the compressor (not KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.delta_store import DeltaBlockStore
from sglang_sparse.methods.kivi import KIVIRuntime, check_fp_fraction
from sglang_sparse.registry import ConfigError, check_range, register_method

METRICS = ("l2", "dot", "cosine")
PAYLOAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class DeltaKVConfig:
    latent: int = 64
    stride: int = 16
    neighbors: int = 4
    metric: str = "l2"
    group: int = 32
    residual: int = 128
    fp_fraction: float = 0.25

    def validate(self) -> None:
        check_range("latent", self.latent, 1, 65536)  # at most 2 x kv heads x head dim (launcher)
        check_range("group", self.group, 1, 1024)
        if self.group & (self.group - 1):
            raise ConfigError(f"group={self.group} must be a power of two")
        check_range("stride", self.stride, 1, self.group)
        if self.group % self.stride:
            raise ConfigError(f"stride={self.stride} must divide group={self.group} (references sit at block "
                              "offsets 0, stride, 2 stride, ...)")
        check_range("neighbors", self.neighbors, 1, 16)
        if self.metric not in METRICS:
            raise ConfigError(f"metric={self.metric!r} is not allowed: must be one of {', '.join(METRICS)}")
        check_range("residual", self.residual, 1)
        check_fp_fraction(self.fp_fraction)


@register_method("deltakv", "compression", DeltaKVConfig,
                 "residual codes against similar earlier tokens (fitted PCA compressor) + fp residual")
class DeltaKVRuntime(KIVIRuntime):
    store_cls = DeltaBlockStore
    blocks_key = "deltakv_blocks"
    reads_rope = True
    decode_kernel_graph_safe = False  # the decode is the plain-torch reference (no GPU kernel)

    def __init__(self, cache, config: DeltaKVConfig | None = None) -> None:
        self._prior: list[int] = []  # the planned request's blocks before this write (``plan``)
        super().__init__(cache, config or DeltaKVConfig())

    def check_layout(self, k0: torch.Tensor) -> None:
        c, width = self.config, 2 * k0.shape[1] * k0.shape[2]
        if c.latent > width:
            raise ConfigError(f"latent={c.latent} is too large: must be at most {width} (the width of a token's K|V)")
        if k0.dtype not in PAYLOAD_DTYPES:
            raise ConfigError(f"--sparse-method deltakv needs a 16- or 32-bit float KV pool (got {k0.dtype})")

    def block_bytes(self, num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        c = self.config
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return DeltaBlockStore.delta_block_bytes(num_layers, 2 * kv_heads * head_dim, c.latent, c.stride,
                                                 c.neighbors, c.group, itemsize)

    def make_store(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, device):
        c = self.config
        return DeltaBlockStore(num_layers, kv_heads, head_dim, num_blocks, c.latent, c.stride, c.neighbors, c.metric,
                               c.group, self.cache.store.k_buffer(0).dtype, device)

    def bind_model(self, info) -> None:
        """``info``: a ``core.runtime.ModelRope`` (the model's RoPE table; the compressor from
        ``info.artifacts["deltakv_compressor"]``), or anything with ``rope`` and ``compressor``."""
        compressor = getattr(info, "compressor", None)
        if compressor is None:
            from sglang_sparse.delta_artifacts import load_deltakv

            if "deltakv_compressor" not in info.artifacts:
                raise RuntimeError("--sparse-method deltakv needs its compressor, which sglang_sparse.launch_server "
                                   "prepares (no deltakv_compressor in the exported configuration)")
            compressor = load_deltakv(info.artifacts["deltakv_compressor"], self.blocks.num_layers, self.config.latent)
        self.blocks.bind(compressor, info.rope)

    def static_bytes(self) -> int:
        return 0 if self.blocks.compressor is None else self.blocks.compressor.bytes()

    def plan(self, rid: str) -> torch.Tensor | None:
        # the new blocks' fathers may point at the request's earlier references
        self._prior = list(self.cache.requests[rid].metadata.get(self.blocks_key, []))
        return super().plan(rid)

    def write_blocks(self, blocks: list[int], slots: torch.Tensor, start: int) -> None:
        if start != len(self._prior) * self.config.group:
            raise RuntimeError(f"deltakv blocks written at logical {start}, after {len(self._prior)} blocks")
        store = self.cache.store
        for layer in range(store.num_layers):
            self.blocks.write(layer, blocks, store.k_buffer(layer)[slots], store.v_buffer(layer)[slots], self._prior)

    @classmethod
    def prepare_artifacts(cls, config, model_dir: str, argv: list[str], log) -> dict:
        from sglang_sparse import delta_artifacts

        return delta_artifacts.prepare_deltakv(config, model_dir, argv, log)
