"""The tensor-only decode hook (``SparseController.decode_view_tensors``) of the ``graph_decode``
methods that run on the toy engine traces whole under torch.compile (``fullgraph``: no graph
break), is not recompiled as decoding goes on (a guard on a step-varying Python value would
recompile every step under ``--enable-torch-compile``), and returns the views of eager
decoding. CPU only: dynamo traces, the graph runs eagerly (no inductor codegen); the GPU server
test ``test_gpu_server.py::test_torch_compile_gives_the_eager_tokens`` compiles for real.
PyramidKV, KVzip and KIVI decode over their own stores (per-layer cells, quantized blocks) and
are not driven by the toy engine."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from toy_engine import LAYERS, ToyEngine, qkv

CASES = {
    "quest": {"token_budget": 64, "page_size": 16},
    "omnikv": {"filter_layers": "1", "token_budget": 64},
    # online eviction: the hook only accumulates scores in place (no view: SGLang's own kernel
    # reads the rows); the evictions those scores decide every few steps are compared instead
    "h2o": {"budget": 64, "recent": 16, "interval": 4},
    "rkv": {"budget": 64, "interval": 8, "window": 8},
    "skipkv": {"budget": 96, "recent": 16, "max_segment": 32, "sinks": 4, "interval": 4},
}
STEPS = 12


def _flat(view):
    if view is None:
        return [None]
    return [x.clone() if torch.is_tensor(x) else x for x in
            (getattr(view, f.name) for f in dataclasses.fields(view))]


def _decode(method: str, steps: int, counter: CompileCounter | None):
    eng = ToyEngine(method, CASES[method], slots=1024)
    if counter is not None:
        eng.ctl.decode_view_tensors = torch.compile(eng.ctl.decode_view_tensors, fullgraph=True,
                                                    backend=counter, dynamic=False)
    q, k, v = qkv(300, seed=1)
    eng.prefill("a", 0, q, k, v, chunk=128)
    views, freed = [], []
    for t in range(steps):
        dq, dk, dv = qkv(1, seed=100 + t)
        eng.views.clear()
        freed.append(eng.decode("a", 0, dq, dk, dv))
        views.append([(layer, _flat(view)) for layer, view in eng.views])  # copied: buffers are reused
    kept = [eng.ctl.cache.retained("a").layer_positions(layer) for layer in range(LAYERS)]
    return views, freed, kept


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("method", sorted(CASES))
def test_decode_hook_traces_whole_and_once(method):
    torch._dynamo.reset()
    views, freed, kept = _decode(method, STEPS, None)
    # the case exercises the hook: a view chosen, or evictions decided by the scores it keeps
    assert any(view != [None] for step in views for _, view in step) or sum(freed) > 0
    short = CompileCounter()
    _decode(method, 2, short)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = _decode(method, STEPS, counter)
    assert counter.frame_count > 0, "the hook was not traced"
    # as many graphs after STEPS decode steps as after 2: nothing recompiles per step
    assert counter.frame_count == short.frame_count
    assert _same(compiled[0], views) and compiled[1] == freed and _same(compiled[2], kept)
