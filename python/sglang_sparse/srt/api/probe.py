"""Engine probes in the HTTP process: a method that ``needs_engine_probe`` (KVzip) scores the
prompt with a probe that the engine prefills after it, as more prefill of the same request.

The client's prompt of N tokens (after tokenization, in ``before_validate_one_request``) is
rewritten in place to ``prompt[:N-1] + probe_ids(prompt[:N-1])`` (N - 1 + S tokens), and
``sampling_params.custom_params`` carries ``PROBE_PARAM = {"context": N - 1, "last": prompt[-1],
"hidden": S}`` to the scheduler (``engine/probe.py``), which:

- starts the request with ``runtime.probe_metadata(N - 1)``;
- after the last prompt chunk replaces the sampled token by ``last`` (the decode input) and moves
  it from the output into the prompt, so the client never sees it;
- the method's compaction drops the probe rows (logical ``[N-1, N-1+S)``) at the next safe point,
  and the first decode step feeds ``last`` at logical position N - 1: the first generated token
  comes from the prompt's last token over the compacted context.

The scheduler reports ``len(origin_input_ids) = N + S`` prompt tokens; ``fix_prompt_tokens``
gives the client its N back (``meta_info.prompt_tokens``, hence OpenAI ``usage``).
A one-token prompt has no context to score and is served as is; ``n > 1`` (parallel samples of
one prompt), SGLang sessions (``session_params``: SGLang would build the next prompt from this
one, probe included) and ``max_new_tokens`` 0 (SGLang's prefill-only path never samples the token
the probe replaces) are refused with a 400.

A request that continues a chain (``custom_params.chain_id``) is not rewritten here: only the
scheduler knows how many of its tokens the chain holds (M), and the probe covers the new context
``prompt[M:N-1]`` alone. ``PROBE_PARAM`` then also carries the probe's fixed token ids
(``texts``), the prompt's field name and ``chain: true``; the scheduler rewrites the prompt
(``engine/probe.rebase``) and reports the probe's length back in the chain fields of the first
output (``chains/http.py`` stores it for ``fix_prompt_tokens``).
"""

from __future__ import annotations

import functools

from sglang_sparse.validation import RequestError

PROBE_PARAM = "sglang_sparse_engine_probe"


@functools.lru_cache(maxsize=1)
def _method():
    """(runtime class, method config) of this server when its method needs the engine probe."""
    from sglang_sparse.methods import build_config, get_method
    from sglang_sparse.srt import activation

    config = activation.load_config()
    method = config.get("method", "dense")
    runtime = get_method(method).runtime_cls
    if not runtime.needs_engine_probe:
        return None
    return runtime, build_config(method, config.get("options")), method


def _hidden() -> dict:
    from sglang_sparse.srt.state import STATE

    return STATE.http.probe_hidden


def rewrite_prompt(manager, obj, input_ids: list, field: str) -> None:
    """Prefix the probe (see the module docstring); 400 naming ``field`` if context + probe +
    the requested output do not fit the model's context length."""
    found = _method()
    if found is None or len(input_ids) < 2:
        return
    runtime, config, method = found
    sp = obj.sampling_params if isinstance(obj.sampling_params, dict) else {}
    if obj.session_params is not None:
        raise RequestError("session_params", f"--sparse-method {method} prefills a reconstruction probe after each "
                                             "prompt, which SGLang would carry into the session's next prompt: "
                                             "leave session_params out and continue the conversation with chain_id")
    n = sp.get("n", 1)
    if (getattr(obj, "parallel_sample_num", 1) or 1) > 1 or (isinstance(n, int) and n > 1):
        raise RequestError("n", f"--sparse-method {method} prefills a reconstruction probe per request and cannot "
                                "serve parallel samples of one prompt (n > 1) yet: send n = 1, as separate requests")
    if sp.get("max_new_tokens", 1) == 0:  # SGLang serves it prefill-only: the probe's first token never comes
        raise RequestError("sampling_params.max_new_tokens", f"--sparse-method {method} compresses a prompt for the "
                                                             "tokens generated after it: max_new_tokens must be "
                                                             ">= 1 (it was 0)")
    tokenizer = manager.tokenizer
    context = list(input_ids[:-1])
    texts = runtime.probe_texts(lambda text: tokenizer.encode(text, add_special_tokens=False))
    custom = dict(sp.get("custom_params") or {})
    if "chain_id" in custom:  # the scheduler probes the new context once it knows the chain's part
        custom[PROBE_PARAM] = {"context": len(context), "last": int(input_ids[-1]), "hidden": 0, "chain": True,
                               "texts": texts, "field": field}
        obj.sampling_params = {**sp, "custom_params": custom}
        if isinstance(obj.rid, str):
            _hidden()[obj.rid] = 0  # set from the first output (chains/http.py)
        return
    probe = runtime.probe_ids(config, context, texts)
    max_new = sp.get("max_new_tokens") or 0
    message = too_long(field, method, len(input_ids), len(probe), max_new if isinstance(max_new, int) else 0,
                       manager.max_req_input_len, manager.context_len)
    if message is not None:
        raise RequestError(field, message)
    custom[PROBE_PARAM] = {"context": len(context), "last": int(input_ids[-1]), "hidden": len(probe)}
    obj.sampling_params = {**sp, "custom_params": custom}
    input_ids[:] = context + probe  # the list SGLang goes on to tokenize into the request
    if isinstance(obj.rid, str):
        _hidden()[obj.rid] = len(probe)


def too_long(field: str, method: str, prompt: int, probe: int, max_new: int, max_input, context_len: int):
    """The 400 sentence for a prompt of ``prompt`` tokens whose probe of ``probe`` tokens does not
    fit the scheduler's input limit or the model's context length (None: it fits). The HTTP
    process checks a whole prompt's probe, the scheduler a chain continuation's."""
    prefill = prompt - 1 + probe
    if max_input is not None and prefill >= max_input:
        return (f"{field} gives a prompt of {prompt} tokens; --sparse-method {method} prefills a reconstruction "
                f"probe of {probe} tokens after it, and the {prefill} tokens of prompt + probe reach this server's "
                f"input limit of {max_input} tokens: send a shorter prompt (the probe repeats the tokens it "
                "scores: the whole prompt, or a chain continuation's new tokens)")
    need = prompt + probe + max_new
    if need > context_len:
        return (f"{field} gives a prompt of {prompt} tokens; --sparse-method {method} prefills a reconstruction "
                f"probe of {probe} tokens after it, and prompt + probe + max_new_tokens ({max_new}) = {need} tokens "
                f"exceed the model's context length of {context_len} tokens: send a shorter prompt or ask for "
                "fewer new tokens")
    return None


def fix_prompt_tokens(outputs, obj):
    """Wrap ``generate_request``'s outputs of ``obj``: ``meta_info.prompt_tokens`` without the
    probe. The rids' entries go when the generator ends (also on an error before any output)."""
    if _method() is None:
        return outputs

    async def fixed():
        hidden = _hidden()
        seen = set()
        try:
            async for out in outputs:
                for item in out if isinstance(out, list) else [out]:
                    meta = item.get("meta_info") if isinstance(item, dict) else None
                    rid = meta.get("id") if isinstance(meta, dict) else None
                    if rid in hidden and isinstance(meta.get("prompt_tokens"), int):
                        seen.add(rid)
                        meta["prompt_tokens"] -= hidden[rid]
                yield out
        finally:
            rids = obj.rid if isinstance(obj.rid, list) else [obj.rid]
            for rid in seen.union(r for r in rids if isinstance(r, str)):
                hidden.pop(rid, None)

    return fixed()
