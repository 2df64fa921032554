"""The loaded model's RoPE table, for a ``reads_rope`` method (DeltaKV stores pre-RoPE K: it
un-rotates the pool's rows and rotates its reconstructions with the model's own table, so scaled
RoPE variants are reproduced exactly).

SGLang 0.5.23's Llama-family attention modules hold ``rotary_emb`` (``get_rope``), whose
``cos_sin_cache [max_pos, rotary_dim]`` is cos of each frequency then its sin and whose
``is_neox_style`` picks halves or pairs (``sgl_kernel_sparse.palu`` has the formulas); every
layer shares one table.
"""

from __future__ import annotations

from sglang_sparse.core.lowrank import RopeTable


def model_rope(model_runner) -> RopeTable:
    for m in model_runner.model.modules():
        rope = getattr(m, "rotary_emb", None)
        if rope is not None and hasattr(rope, "cos_sin_cache") and hasattr(m, "attn"):
            return RopeTable(rope.cos_sin_cache.detach().float(), bool(rope.is_neox_style))
    raise RuntimeError(f"no attention module with a rotary_emb.cos_sin_cache in {type(model_runner.model).__name__}: "
                       "the method needs the model's RoPE table")
