"""KV-pool sizing from a model config (engine-agnostic: plain dicts and integers).

One *slot* holds one token's K and V in every layer, so a dense pool of N slots costs
``N * kv_bytes_per_token(config)`` bytes. Sparse methods change how many slots a request
holds, not the size of a slot.
"""

from __future__ import annotations

DTYPE_BYTES = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}

# A CPU pool larger than this only costs start-up time: a 2-core machine cannot keep
# more than a few long requests busy anyway.
CPU_POOL_CAP_TOKENS = 65536
CPU_POOL_MEMORY_FRACTION = 0.25


def dtype_bytes(name: str) -> int:
    try:
        return DTYPE_BYTES[name.lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPE_BYTES)}") from None


def kv_bytes_per_token(config: dict, kv_dtype: str | None = None) -> int:
    """Bytes of K+V for one token across all layers of a dense-attention HF config."""
    text = config.get("text_config", config)
    layers = int(text["num_hidden_layers"])
    q_heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or q_heads)
    head_dim = int(text.get("head_dim") or text["hidden_size"] // q_heads)
    dtype = kv_dtype or text.get("torch_dtype") or text.get("dtype") or "bfloat16"
    return layers * kv_heads * head_dim * 2 * dtype_bytes(str(dtype))


def cpu_pool_tokens(bytes_per_token: int, available_bytes: int, context_len: int) -> int:
    """A pool for a CPU server: a quarter of available memory, at most CPU_POOL_CAP_TOKENS,
    and never less than one full context (SGLang refuses a pool smaller than a request)."""
    by_memory = int(available_bytes * CPU_POOL_MEMORY_FRACTION) // max(bytes_per_token, 1)
    return max(min(by_memory, CPU_POOL_CAP_TOKENS), context_len)
