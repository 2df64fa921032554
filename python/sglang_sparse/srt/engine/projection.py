"""The K/V projection of a ``projects_kv`` method (Palu's low-rank factors), installed once the
model's weights are loaded.

``after_load_model`` (HookRegistry AFTER hook on ``ModelRunner.load_model``: the weights are
loaded, the KV pool, attention backends and CUDA graphs are not built yet) finds every attention
module of the model that computes ``qkv, _ = self.qkv_proj(hidden_states)`` and then splits it into
``q_size / kv_size / kv_size`` columns (SGLang 0.5.23: ``LlamaAttention.forward_prepare_native``,
llama.py:243-247; the same shape in the other Llama-family attentions), and registers a torch
forward hook on its ``qkv_proj`` (``LatentProjection``): the hook returns the projection's output
with the K and V columns replaced by the low-rank reconstruction ``h_k B_k (+ b_k)`` /
``h_v B_v (+ b_v)``, ``h = x A`` (one matmul for both latents). The model's own code then splits,
rotates K (its RoPE) and writes the pool: every attention sees the low-rank K/V, and the rows the
method later moves into its store lie exactly in the span of B (``core/latent_store.py``).

The factors come from the method (``projection_factors``: Palu reads the file the launcher
prepared, ``config["artifacts"]``, and cuts it to the configured rank); the runtime gets them with
the model's RoPE table through ``STATE.scheduler.model_info`` (``controller.ensure_controller`` calls
``bind_model``). A per-head ``k_norm`` between the projection and RoPE (Qwen3,
``forward_prepare_native``) is allowed with per-head factors: the runtime gets factors whose keys
carry its weight (``PaluFactors.with_key_gain``). Under tensor parallelism each rank's hook holds
the factors of its own KV head groups (``PaluFactors.shard``).
"""

from __future__ import annotations

import logging

import torch

from sglang_sparse.core.lowrank import LatentModel, RopeTable
from sglang_sparse.methods import build_config, get_method
from sglang_sparse.srt import activation
from sglang_sparse.srt.state import STATE

logger = logging.getLogger("sglang_sparse")


class LatentProjection:
    """A torch forward hook on one layer's ``qkv_proj``: ``(module, (x,), (qkv, bias)) ->
    (qkv', bias)`` with qkv' = [q | h_k B_k + b_k | h_v B_v + b_v], ``h = x A``."""

    def __init__(self, q_size: int, kv_size: int, a, bk, bv, bias_k, bias_v) -> None:
        self.q_size, self.kv_size = q_size, kv_size
        self.a, self.bk, self.bv, self.bias_k, self.bias_v = a, bk, bv, bias_k, bias_v
        self.half = a.shape[1] // 2

    def __call__(self, module, args, output):
        qkv, bias = output
        x = args[0]
        h = x.to(self.a.dtype) @ self.a
        k = h[..., : self.half] @ self.bk
        v = h[..., self.half:] @ self.bv
        if self.bias_k is not None:
            k, v = k + self.bias_k, v + self.bias_v
        return torch.cat([qkv[..., : self.q_size], k.to(qkv.dtype), v.to(qkv.dtype)], dim=-1), bias


def _attention_modules(model) -> list:
    found = [m for m in model.modules()
             if hasattr(m, "qkv_proj") and hasattr(m, "attn") and hasattr(m, "q_size") and hasattr(m, "kv_size")
             and hasattr(m, "rotary_emb") and hasattr(m.attn, "layer_id")]
    return sorted(found, key=lambda m: m.attn.layer_id)


def after_load_model(result, model_runner, *args, **kwargs):
    config = activation.load_config()
    method = config.get("method", "dense")
    if not get_method(method).runtime_cls.projects_kv:
        return None  # only projects_kv methods get here (inventory condition); a safety net
    runtime_cls = get_method(method).runtime_cls
    cfg = build_config(method, config.get("options"))
    attns = _attention_modules(model_runner.model)
    if not attns:
        raise RuntimeError(f"--sparse-method {method}: no attention module with qkv_proj / q_size / kv_size / "
                           f"rotary_emb in {type(model_runner.model).__name__}; the projection hook cannot be "
                           "installed")
    first = attns[0]
    # tensor parallelism: this rank's qkv_proj computes its own KV heads, so it takes its share of
    # the factors (the launcher checked that head groups do not straddle ranks)
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    shard = (int(group.rank_in_group), int(group.world_size))
    if shard[1] > 1 and first.num_kv_heads * shard[1] != first.total_num_kv_heads:
        raise RuntimeError(f"--sparse-method {method}: {first.total_num_kv_heads} KV heads are replicated over "
                           f"{shard[1]} ranks; the factors need each head on one rank")
    head_dim = first.kv_size // first.num_kv_heads

    def loaded_kv():  # [(W_k, W_v)] of every layer: the weights SGLang loaded (--load-format dummy)
        return [(m.qkv_proj.weight[m.q_size: m.q_size + m.kv_size].detach(),
                 m.qkv_proj.weight[m.q_size + m.kv_size: m.q_size + 2 * m.kv_size].detach()) for m in attns]

    factors = runtime_cls.projection_factors(cfg, config.get("artifacts") or {}, len(attns), first.num_kv_heads,
                                             head_dim, loaded_kv, shard)
    device = next(model_runner.model.parameters()).device
    for i, m in enumerate(attns):
        if m.attn.layer_id != i:
            raise RuntimeError(f"--sparse-method {method}: attention layers are not numbered 0..{len(attns) - 1}")
        w = m.qkv_proj.weight
        bias = m.qkv_proj.bias if getattr(m.qkv_proj, "bias", None) is not None and \
            not getattr(m.qkv_proj, "skip_bias_add", False) else None
        bias_k = None if bias is None else bias[m.q_size: m.q_size + m.kv_size].detach().float()
        bias_v = None if bias is None else bias[m.q_size + m.kv_size: m.q_size + 2 * m.kv_size].detach().float()
        factors.bias_k[i], factors.bias_v[i] = bias_k, bias_v
        dt = w.dtype
        hook = LatentProjection(
            m.q_size, m.kv_size, factors.a[i].to(device, dt), factors.block_diag(i, "k").to(device, dt),
            factors.block_diag(i, "v").to(device, dt), None if bias_k is None else bias_k.to(device, dt),
            None if bias_v is None else bias_v.to(device, dt))
        m.qkv_proj.register_forward_hook(hook)
    norms = [getattr(m, "k_norm", None) for m in attns]
    if any(n is not None for n in norms):
        if factors.head_group != 1 or any(n is None or getattr(n, "weight", None) is None for n in norms) \
                or any(b is not None for b in factors.bias_k):  # a bias before the norm leaves the span
            raise RuntimeError(f"--sparse-method {method}: a per-head k_norm needs per-head factors (--sparse-head-group "
                               "1) in every layer and no K bias")
        factors = factors.with_key_gain([n.weight.detach().float().cpu() for n in norms])  # what the pool holds
    rope = first.rotary_emb
    STATE.scheduler.model_info = LatentModel(factors, RopeTable(rope.cos_sin_cache.detach().float(),
                                                                bool(rope.is_neox_style)))
    logger.info("sglang_sparse: %s projects K/V through rank %d x %d groups (head group %d) in %d layers",
                method, factors.rank, factors.n_groups, factors.head_group, len(attns))
    return None
