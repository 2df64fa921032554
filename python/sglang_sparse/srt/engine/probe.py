"""Engine probes in the scheduler (methods that ``needs_engine_probe``: KVzip).

The HTTP side (``api/probe.py``) sent a client prompt of N tokens as ``prompt[:N-1] + probe``
with ``custom_params[PROBE_PARAM] = {"context": P = N-1, "last": prompt[N-1], "hidden": S}``.

```
 logical   0 ........ P-1 | P ......... P+S-1      prefill: context, then the probe
 rows      0 ........ P-1 | P ......... P+S-1      (identity while the probe runs)
 after the compaction (safe point): rows [0, B_l) per layer hold kept context positions < P,
 logical_len = P; decode step 1 writes ``last`` at row B (= resident rows) with RoPE/logical
 position P (= N-1); its output is the first generated token; later tokens follow at N, N+1...
```

- ``start_metadata``: the request starts with ``runtime.probe_metadata(P)``;
- ``force_first_tokens`` (after the forward of the last prompt chunk): the sampled token (a
  prediction after the probe) is replaced by ``last``, which becomes the first decode input;
- ``around_update_finish_state``: SGLang appended it to the output; it moves into the prompt
  (``origin_input_ids``: N + S tokens), so finish checks, ``max_new_tokens`` and the
  detokenized text see only generated tokens. ``sparse(req).hidden = S + 1``: the prompt tokens
  after the logical prompt (``steps.step_from_batch`` reports ``prompt_len = P``);
- ``rebase`` (a chain continuation, from ``chains/scheduler.after_create_req`` once the chain's
  processed length M is known): the HTTP process left the client's prompt as it was; it becomes
  ``prompt[:N-1] + probe_ids(prompt[:N-1], start=M)`` (the probe of the new context only), or
  stays as it is with no probe when the prompt adds nothing before its last token (M = N - 1);
- ``logical_tokens``: the tokens the request's KV stands for (what a chain records): the prompt
  without the probe, the last prompt token, the output.
"""

from __future__ import annotations

from sglang_sparse.core.chain_index import ChainError
from sglang_sparse.srt import activation
from sglang_sparse.srt.api.probe import PROBE_PARAM, too_long
from sglang_sparse.srt.state import sparse


class ProbeTooLong(ChainError):
    status = 400


def probe_param(req, pending: bool = False) -> dict | None:
    """The request's probe parameters; a chain continuation's only once ``rebase`` ran (or with
    ``pending``)."""
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    value = params.get(PROBE_PARAM) if isinstance(params, dict) else None
    if not isinstance(value, dict) or (value.get("chain") and not pending):
        return None
    return value


def start_metadata(req, runtime) -> dict | None:
    """The metadata a probed request starts with (None: not probed, or probed already)."""
    param = probe_param(req)
    if param is None or not runtime.needs_engine_probe or sparse(req).hidden:
        return None
    return runtime.probe_metadata(int(param["context"]), int(param.get("start", 0)))


def rebase(req, boundary: int, scheduler, runtime) -> int | None:
    """A chain continuation resuming ``boundary`` (M) logical tokens: put the probe of its new
    context ``[M, N-1)`` after ``prompt[:N-1]`` (see the module docstring). Returns the probe's
    length (None: not a probed chain request). Raises ``ProbeTooLong`` (400) before anything
    changed when prompt + probe do not fit."""
    param = probe_param(req, pending=True)
    if param is None or not param.get("chain"):
        return None
    context = int(param["context"])
    if boundary >= context:  # nothing new before the last token: no probe, the prompt as sent
        drop(req)
        return 0
    ids = list(req.origin_input_ids[:context])
    probe = runtime.probe_ids(runtime.config, ids, param["texts"], boundary)
    method = activation.load_config().get("method", "dense")
    message = too_long(param["field"], method, context + 1, len(probe), req.sampling_params.max_new_tokens or 0,
                       getattr(scheduler, "max_req_input_len", None), scheduler.model_config.context_len)
    if message is not None:
        raise ProbeTooLong(message)
    same = req.origin_input_ids_unpadded is req.origin_input_ids
    for seq in [req.origin_input_ids] + ([] if same else [req.origin_input_ids_unpadded]):
        del seq[context:]
        seq.extend(probe)
    param.update(hidden=len(probe), start=boundary, chain=False)
    param.pop("texts", None)
    return len(probe)


def drop(req) -> None:
    """The request runs without a probe (its prompt is the client's)."""
    params = req.sampling_params.custom_params
    if isinstance(params, dict):
        params.pop(PROBE_PARAM, None)


def logical_tokens(req) -> list[int]:
    """The tokens a request's KV stands for: ``origin_input_ids`` holds the context, the probe and
    (once moved there) the prompt's last token; the probe is no logical token."""
    ids = list(req.origin_input_ids)
    hidden = sparse(req).hidden
    if hidden:
        ids = ids[: len(ids) - hidden] + ids[-1:]
    return ids + list(req.output_ids)


def force_first_tokens(step, batch, result) -> None:
    """After the forward: a probed request's last prompt chunk outputs its prompt's last token."""
    for i, (r, req) in enumerate(zip(step.requests, batch.reqs)):
        param = probe_param(req)
        if param is None or sparse(req).hidden or not r.is_last_prompt_chunk:
            continue
        result.next_token_ids[i] = int(param["last"])  # the first decode input (relayed after this)
        sparse(req).forced = int(param["last"])


def around_update_finish_state(original, req, *args, **kwargs):
    st = sparse(req)
    if st.forced is not None and len(req.output_ids) == 1 and not req.finished():
        token = req.output_ids.pop()
        assert token == st.forced, (req.rid, token, st.forced)
        same = req.origin_input_ids_unpadded is req.origin_input_ids
        req.origin_input_ids.append(token)
        if not same:
            req.origin_input_ids_unpadded.append(token)
        st.hidden, st.forced = int(probe_param(req)["hidden"]) + 1, None
        if req.to_finish is None:
            return None  # nothing generated yet: nothing to check
    return original(req, *args, **kwargs)
