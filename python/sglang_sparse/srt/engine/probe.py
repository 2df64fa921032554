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
  after the logical prompt (``steps.step_from_batch`` reports ``prompt_len = P``).
"""

from __future__ import annotations

from sglang_sparse.srt.api.probe import PROBE_PARAM
from sglang_sparse.srt.state import sparse


def probe_param(req) -> dict | None:
    params = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    value = params.get(PROBE_PARAM) if isinstance(params, dict) else None
    return value if isinstance(value, dict) else None


def start_metadata(req, runtime) -> dict | None:
    """The metadata a probed request starts with (None: not probed, or probed already)."""
    param = probe_param(req)
    if param is None or not runtime.needs_engine_probe or sparse(req).hidden:
        return None
    return runtime.probe_metadata(int(param["context"]))


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
