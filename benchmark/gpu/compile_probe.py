"""Do Quest's and OmniKV's graph-safe decode hooks trace under torch.compile as SGLang uses it
(``--enable-torch-compile``: the decode forward compiled with mode max-autotune-no-cudagraphs,
then captured into a CUDA graph)? Without a server: a 36-layer stand-in forward (a norm-like op
between layers, the method's ``decode_view_tensors`` through the controller, then the kernel of
the view it returns) is compiled, run twice, captured and replayed; prints graph breaks and
recompiles (``TORCH_LOGS=graph_breaks,recompiles`` for the reasons), whether a fullgraph trace
succeeds, and whether the replay equals eager.

    TORCH_LOGS=graph_breaks,recompiles python3 benchmark/gpu/compile_probe.py --method quest omnikv
"""

from __future__ import annotations

import argparse
import json
import types

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from sglang_sparse.core.controller import SparseController
from sglang_sparse.core.events import DecodeBatch
from sglang_sparse.core.views import RowsTailDecodeView
from sglang_sparse.kernels.decode import decode_over_pages, decode_over_rows_tail
from sglang_sparse.registry import get_method

HQ, HKV, D, PAGE = 32, 8, 128, 16


def build(method: str, layers: int, b: int, ctx: int, dev):
    spec = get_method(method)
    flags = {"quest": dict(token_budget=512), "omnikv": dict(token_budget=512, filter_layers="2,8,18")}[method]
    cache = types.SimpleNamespace(store=types.SimpleNamespace(num_layers=layers))  # what the hooks read
    runtime = spec.runtime_cls(cache, spec.config_cls(**flags))
    ctl = SparseController(runtime)
    pages = -(-(ctx + 64) // PAGE)
    slots = b * pages * PAGE + PAGE
    g = torch.Generator(device=dev).manual_seed(0)
    kc = [torch.randn(slots, HKV, D, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(layers)]
    vc = [torch.randn_like(k) for k in kc]
    table = torch.zeros(b + 1, pages * PAGE, dtype=torch.int32, device=dev)
    for i in range(b):
        table[i] = torch.arange(PAGE + i * pages * PAGE, PAGE + (i + 1) * pages * PAGE, device=dev, dtype=torch.int32)
    req = torch.arange(b, device=dev)
    n_rows = torch.full((b,), ctx, device=dev)
    slot = table[req, n_rows - 1].long()
    all_pages = torch.arange(pages, device=dev).view(1, 1, -1).expand(b, HQ, -1).contiguous()
    if method == "omnikv":  # the prompt's rows, as prefill would have recorded them
        runtime._buffers(table.shape[0], dev)
        runtime.prompt_rows[:b] = ctx - 8
    if method == "quest":  # summaries of the whole context, as prefill would have folded them
        for l in range(layers):
            kmin, kmax = runtime._pages(l, kc[l])
            for i in range(b):
                s = table[i, :ctx].long()
                runtime_fold(kmin, kmax, kc[l][s], s)
    return ctl, kc, vc, table, req, n_rows, slot, all_pages


def runtime_fold(kmin, kmax, k, s):
    from sglang_sparse.kernels import quest_pages
    quest_pages.add_keys(kmin, kmax, k, s, PAGE)


def make_forward(ctl, kc, vc, table, req, n_rows, slot, all_pages):
    scale = D ** -0.5

    def forward(x):
        for l in range(len(kc)):
            h = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
            q = h.view(-1, HQ, D)
            knew = q[:, :HKV].contiguous()
            batch = DecodeBatch(l, q, knew, req, n_rows, slot, table, kc[l], vc[l])
            view = ctl.decode_view_tensors(batch)
            if view is None:
                o = decode_over_pages(q, kc[l], vc[l], table, req, all_pages, n_rows, PAGE, scale)
            elif isinstance(view, RowsTailDecodeView):
                o = decode_over_rows_tail(q, kc[l], vc[l], table, req, view.sel_rows, view.tail_start,
                                          view.n_rows, scale)
            else:
                o = decode_over_pages(q, kc[l], vc[l], table, req, view.page_ids, view.n_rows, view.page_size, scale)
            x = x + o.reshape(x.shape).to(x.dtype)
        return x

    return forward


def probe(method, layers, b, ctx):
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run (reference kernels)
    ctl, *rest = build(method, layers, b, ctx, dev)
    fwd = make_forward(ctl, *rest)
    x = torch.randn(b, HQ * D, device=dev, dtype=torch.bfloat16)
    res = {"method": method}
    torch._dynamo.reset()
    try:
        torch.compile(fwd, fullgraph=True, dynamic=False)(x.clone())
        res["fullgraph"] = "ok"
    except Exception as exc:  # noqa: BLE001 - the first break's reason is the finding
        res["fullgraph"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    torch._dynamo.reset()
    counters.clear()
    comp = torch.compile(torch.no_grad()(fwd), mode="max-autotune-no-cudagraphs", dynamic=False)
    want = fwd(x.clone())
    for _ in range(2):
        got = comp(x.clone())
    res["compiled_equals_eager"] = bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
    res["graph_breaks"] = sum(counters["graph_break"].values())
    res["break_reasons"] = sorted(counters["graph_break"])[:10]
    res["unique_graphs"] = counters["stats"].get("unique_graphs", 0)
    res["frames"] = counters["stats"].get("calls_captured", 0)
    before = dict(counters["stats"])
    if dev == "cpu":
        return res
    try:
        xin = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comp(xin)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = comp(xin)
        graph.replay()
        torch.cuda.synchronize()
        res["graph_replay_equals_eager"] = bool(torch.allclose(out.float(), want.float(), atol=2e-2, rtol=2e-2))
    except Exception as exc:  # noqa: BLE001
        res["graph_capture"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    res["compiles_during_capture"] = counters["stats"].get("unique_graphs", 0) - before.get("unique_graphs", 0)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", nargs="+", default=["quest", "omnikv"])
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = [probe(m, args.layers, args.batch, args.ctx) for m in args.method]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
