"""Chain Cache in the HTTP process: the chain fields of responses.

- ``meta_info`` (``/generate``): the scheduler attaches ``chain_id`` / ``chain_status`` /
  ``reused_tokens`` to a request's first output (SGLang's per-token ``customized_info``, padded
  with None for other requests and later tokens); ``around_update_meta_info`` moves them into
  ``meta_info``.
- OpenAI ``usage``: the same fields (one choice), or ``chains`` (one entry per choice, ``n > 1``);
  streamed responses remember them while the generator runs (``STATE.http.stream_chain``: an
  async generator runs in the context of the task that iterates it) for the final usage chunk.
  SGLang's ``UsageInfo`` ignores extra attributes, so it is rebuilt with ``extra="allow"``.

The ``chain_id`` of a request is checked and moved into ``custom_params`` by ``http/requests.py``.
"""

from __future__ import annotations

from sglang_sparse.srt.chains.scheduler import INFO_KEY, PROBE_INFO
from sglang_sparse.srt.state import STATE


def around_update_meta_info(original, manager, meta_info, state_, customized_info, index, *args, **kwargs):
    """Move the chain fields from SGLang's per-token customized info into ``meta_info``. The
    scheduler attaches them to a request's first output token; SGLang pads the other requests of
    a batch (and later tokens) with None."""
    out = original(manager, meta_info, state_, customized_info, index, *args, **kwargs)
    values = meta_info.pop(INFO_KEY, None)
    info = next((v for v in values if isinstance(v, dict)), None) if isinstance(values, list) else None
    if info is not None:
        info = dict(info)
        probe = info.pop(PROBE_INFO, None)  # a resumed KVzip request's probe: for fix_prompt_tokens
        if probe is not None and meta_info.get("id") in STATE.http.probe_hidden:
            STATE.http.probe_hidden[meta_info["id"]] = probe
        meta_info.update(info)
    return out


CHAIN_FIELDS = ("chain_id", "chain_status", "reused_tokens")


def _fields(meta) -> dict:
    return {k: meta[k] for k in CHAIN_FIELDS if isinstance(meta, dict) and k in meta}


def allow_usage_fields() -> None:
    """Let OpenAI ``usage`` objects carry the chain fields: SGLang's ``UsageInfo`` ignores extra
    attributes, and the response models embed its schema, so both are rebuilt."""
    from sglang.srt.entrypoints.openai import protocol

    protocol.UsageInfo.model_config["extra"] = "allow"
    protocol.UsageInfo.model_rebuild(force=True)
    for name in ("ChatCompletionResponse", "CompletionResponse", "ChatCompletionStreamResponse",
                 "CompletionStreamResponse"):
        getattr(protocol, name).model_rebuild(force=True)


def _set_usage(usage, by_index: dict) -> None:
    """One choice: ``chain_id`` / ``chain_status`` / ``reused_tokens``. Several (``n > 1``, each
    its own chain): ``chains``, one entry per choice in index order."""
    if len(by_index) == 1:
        for k, v in next(iter(by_index.values())).items():
            setattr(usage, k, v)
    elif by_index:
        usage.chains = [{"index": i, **by_index[i]} for i in sorted(by_index)]


def around_generate_request(original, manager, obj, *args, **kwargs):
    outputs = original(manager, obj, *args, **kwargs)

    async def remember_chain():
        seen: dict = {}
        STATE.http.stream_chain.set(seen)
        async for out in outputs:
            for item in out if isinstance(out, list) else [out]:
                fields = _fields(item.get("meta_info") if isinstance(item, dict) else None)
                if fields:
                    seen[item.get("index", 0)] = fields
            yield out

    return remember_chain()


def after_response_usage(usage, responses, *args, **kwargs):
    by_index = {}
    for i, r in enumerate(responses):
        fields = _fields(r.get("meta_info"))
        if fields:
            by_index[r.get("index", i)] = fields
    _set_usage(usage, by_index)
    return None


def after_streaming_usage(usage, *args, **kwargs):
    _set_usage(usage, STATE.http.stream_chain.get() or {})
    return None
