"""In-place weight updates under a method that projects K/V (``projects_kv``: Palu).

The projection hooks (``engine/projection.py``) replace the K/V columns of every ``qkv_proj`` by
``x A B``, with factors computed from the weights the server started with. After
``/update_weights_from_disk`` (or ``_from_tensor`` / ``_from_distributed`` / ``_from_ipc``) the
model's K/V would still come from the old factors, and the latent store's ``pinv(B)`` would
disagree with new rows: silently wrong outputs. So these routes answer 400 with a sentence (SGLang
turns ``success = False`` into its 400 body); the server keeps serving with its weights."""

from __future__ import annotations

from sglang_sparse.srt import activation


def _message(field: str) -> str:
    method = activation.load_config().get("method", "?")
    return (f"{field}: in-place weight updates are not supported with --sparse-method {method}: it replaces the "
            "model's K/V projections by factors computed from the weights the server started with, which an "
            "update would leave stale; restart the server with the new weights")


async def around_update_from_disk(original, manager, obj, request=None, *args, **kwargs):
    """``(success, message, num_paused_requests)``"""
    return False, _message("model_path"), 0


async def around_update_weights(original, manager, obj, request=None, *args, **kwargs):
    """``(success, message)`` of the tensor / distributed / IPC updates."""
    return False, _message("weights")
