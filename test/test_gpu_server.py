"""The CUDA path through real servers (GPU machine only; skipped elsewhere): SGLang's Triton
backend with the sparse hooks, sgl-kernel-sparse's decode kernel for Quest, SnapKV compaction on
the GPU pool, and dense keeping CUDA graphs with the same tokens as plain SGLang and as eager.

The model is the default model's config and tokenizer with random weights (``--load-format
dummy``; the weights do not travel to the GPU machine): ``$SGLANG_SPARSE_GPU_MODEL``, made by
``benchmark/gpu/prepare.sh``. Greedy tokens of random weights are still deterministic, so token
equality between two servers running the same kernels is a real check."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import start_server

pytestmark = pytest.mark.gpu

POOL = 65536
COMMON = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
          "--max-total-tokens", str(POOL), "--log-level", "warning"]


@pytest.fixture(scope="module")
def model():
    path = os.environ.get("SGLANG_SPARSE_GPU_MODEL", ".gpumodel/smollm2-135m")
    if not os.path.isdir(path):
        pytest.skip(f"no model config at {path} (benchmark/gpu/prepare.sh makes it)")
    return path


def prompts(n_tokens: int, count: int) -> list[list[int]]:
    return [[1000 + (31 * i + 7 * j) % 30000 for j in range(n_tokens)] for i in range(count)]


def generate(srv, ids, n=16) -> dict:
    resp = requests.post(srv.base_url + "/generate", timeout=600, json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(srv) -> dict:
    return requests.get(srv.base_url + "/sparse/stats", timeout=60).json()


def test_dense_with_cuda_graphs_matches_plain_sglang_and_eager(model, request):
    batch = prompts(300, 4)
    args = ["--model-path", model, *COMMON]
    plain = start_server(args, request, module="sglang.launch_server")
    want = [r["output_ids"] for r in generate(plain, batch)]
    plain.stop()
    graphs = start_server(args, request)
    assert [r["output_ids"] for r in generate(graphs, batch)] == want
    assert requests.post(graphs.base_url + "/flush_cache", timeout=60).status_code == 200  # radix-cached KV
    s = stats(graphs)
    assert s["method"] == "dense" and s["steps"] > 0 and s["kv_free_slots"] == s["kv_total_slots"]
    graphs.stop()
    eager = start_server(args + ["--disable-cuda-graph"], request)
    assert [r["output_ids"] for r in generate(eager, batch)] == want


def test_quest_reads_selected_pages_through_the_triton_kernel(model, request):
    page, budget, dense_layers, layers, hq = 16, 64, 2, 30, 9
    srv = start_server(["--model-path", model, *COMMON, "--sparse-method", "quest", "--sparse-page-size",
                        str(page), "--sparse-token-budget", str(budget), "--sparse-dense-layers",
                        str(dense_layers), "--disable-radix-cache"], request)
    before = stats(srv)
    out = generate(srv, prompts(1000, 1)[0], n=2)  # one decode step over 1001 tokens
    assert len(out["output_ids"]) == 2
    after = stats(srv)
    heads = (layers - dense_layers) * hq
    assert after["counters"]["pages_total"] - before["counters"].get("pages_total", 0) == heads * -(-1001 // page)
    assert after["counters"]["pages_selected"] - before["counters"].get("pages_selected", 0) == heads * 4
    # a batch of long requests decodes through the batched kernel and gives every slot back
    for r in generate(srv, prompts(3000, 8), n=24):
        assert len(r["output_ids"]) == 24
    end = stats(srv)
    assert end["kv_free_slots"] == end["kv_total_slots"] and end["counters"]["slots_released"] == 0


OMNIKV = ["--sparse-method", "omnikv", "--sparse-token-budget", "128", "--sparse-filter-layers", "2,8,18"]
GRAPH_METHODS = ("quest", "omnikv")  # selection captured into the decode graphs


QUEST_KV = ["--sparse-method", "quest", "--sparse-token-budget", "128", "--sparse-select-per", "kv_head"]


@pytest.mark.parametrize("flags", [
    ["--sparse-method", "quest", "--sparse-token-budget", "128"],
    QUEST_KV,
    OMNIKV,
    ["--sparse-method", "snapkv", "--sparse-budget", "256"],
], ids=["quest", "quest_kv", "omnikv", "snapkv"])
def test_sparse_decode_with_cuda_graphs_gives_the_eager_tokens(model, request, flags):
    """Quest's and OmniKV's selections are captured into the decode graphs; SnapKV decodes its
    compacted rows in SGLang's own graphs with logical RoPE positions. Same tokens as eager
    decoding. The batch mixes prompts over and under OmniKV's budget."""
    batch = prompts(1000, 3) + prompts(100, 1)
    graphs = start_server(["--model-path", model, *COMMON, *flags], request)
    before = stats(graphs)["counters"].get("decode_layer_python_calls", 0)
    got = [r["output_ids"] for r in generate(graphs, batch, n=24)]
    if flags[1] in GRAPH_METHODS:  # replayed graphs run no Python per layer
        assert stats(graphs)["counters"]["decode_layer_python_calls"] == before
    graphs.stop()
    eager = start_server(["--model-path", model, *COMMON, *flags, "--disable-cuda-graph"], request)
    assert [r["output_ids"] for r in generate(eager, batch, n=24)] == got
    if flags[1] in GRAPH_METHODS:
        assert stats(eager)["counters"]["decode_layer_python_calls"] > 0


ONLINE = {"h2o": ["--sparse-method", "h2o", "--sparse-budget", "256", "--sparse-recent", "64",
                  "--sparse-interval", "16"],
          "rkv": ["--sparse-method", "rkv", "--sparse-budget", "256", "--sparse-window", "8",
                  "--sparse-interval", "16"],
          "skipkv": ["--sparse-method", "skipkv", "--sparse-budget", "256", "--sparse-recent", "64",
                     "--sparse-interval", "16", "--sparse-max-segment", "8"]}
# decode rows between two evictions: interval, and for skipkv up to max_segment more (it keeps
# whole segments, so an eviction may leave fewer rows than the budget)
ONLINE_GAP = {"h2o": 16, "rkv": 16, "skipkv": 16 + 8}


@pytest.mark.parametrize("method", sorted(ONLINE))
def test_online_eviction_scores_in_cuda_graphs_give_the_eager_evictions(model, request, method):
    """H2O's, R-KV's and SkipKV's per-slot scores are accumulated inside the replayed decode graphs (no
    Python per layer): the same evictions, rows released and tokens as eager decoding, and the
    pool whole afterwards."""
    batch = prompts(1000, 3) + prompts(100, 1)
    args = ["--model-path", model, *COMMON, *ONLINE[method], "--chain-cache", "off"]
    runs = []
    for extra in ([], ["--disable-cuda-graph"]):
        srv = start_server(args + extra, request)
        before = stats(srv)["counters"]
        out = [r["output_ids"] for r in generate(srv, batch, n=64)]
        after = stats(srv)
        moved = {k: after["counters"].get(k, 0) - before.get(k, 0)
                 for k in ("evictions", "rows_released", "decode_layer_python_calls")}
        assert after["kv_free_slots"] == after["kv_total_slots"] and after["integrity"]["ok"]
        runs.append((out, moved))
        srv.stop()
    (graph_out, graph), (eager_out, eager) = runs
    assert graph["decode_layer_python_calls"] == 0 < eager["decode_layer_python_calls"]
    assert graph["evictions"] == eager["evictions"] >= 3 + 3 * (63 // ONLINE_GAP[method])  # prompts, then decode
    assert graph["rows_released"] == eager["rows_released"]
    assert graph_out == eager_out


def test_kvzip_probe_and_compaction_on_the_gpu_give_the_eager_tokens(model, request):
    """KVzip on the Triton backend: each prompt's reconstruction probe is prefilled and scored on
    the GPU, the compaction frees the probe and the dropped context rows, and decoding the
    compacted rows with CUDA graphs gives the eager tokens; the pool is whole afterwards."""
    batch = prompts(1000, 3) + prompts(100, 1)
    args = ["--model-path", model, *COMMON, "--sparse-method", "kvzip", "--sparse-keep-ratio", "0.3",
            "--chain-cache", "off"]
    runs = []
    for extra in ([], ["--disable-cuda-graph"]):
        srv = start_server(args + extra, request)
        before = stats(srv)["counters"]
        out = [r["output_ids"] for r in generate(srv, batch, n=24)]
        after = stats(srv)
        moved = {k: after["counters"].get(k, 0) - before.get(k, 0)
                 for k in ("evictions", "rows_released", "kvzip_probes", "kvzip_padded_entries")}
        assert after["kv_free_slots"] == after["kv_total_slots"] and after["integrity"]["ok"]
        runs.append((out, moved))
        srv.stop()
    (graph_out, graph), (eager_out, eager) = runs
    assert graph["kvzip_probes"] == graph["evictions"] == 4
    assert graph == eager and graph["rows_released"] > 0
    assert graph_out == eager_out


@pytest.mark.parametrize("flags", [[], ["--sparse-method", "quest", "--sparse-token-budget", "128"], QUEST_KV, OMNIKV],
                         ids=["dense", "quest", "quest_kv", "omnikv"])
def test_torch_compile_gives_the_eager_tokens(model, request, flags):
    """``--enable-torch-compile`` (SGLang compiles the decode forward, then captures it into
    graphs) with the sparse hooks inside: the same tokens as eager decoding, no leak."""
    batch = prompts(1000, 3) + prompts(100, 1)
    args = ["--model-path", model, *COMMON, *flags]
    compiled = start_server(args + ["--enable-torch-compile", "--torch-compile-max-bs", "4"], request)
    got = [r["output_ids"] for r in generate(compiled, batch, n=24)]
    assert requests.post(compiled.base_url + "/flush_cache", timeout=60).status_code == 200
    s = stats(compiled)
    assert s["kv_free_slots"] == s["kv_total_slots"]
    compiled.stop()
    eager = start_server(args + ["--disable-cuda-graph"], request)
    assert [r["output_ids"] for r in generate(eager, batch, n=24)] == got


def test_snapkv_compacts_on_the_gpu_pool(model, request):
    budget = 256
    srv = start_server(["--model-path", model, *COMMON, "--sparse-method", "snapkv", "--sparse-budget",
                        str(budget), "--chain-cache", "off"], request)  # counts free slots: no idle chains
    before = stats(srv)
    batch = prompts(4000, 6)
    outs = generate(srv, batch, n=32)
    assert all(len(r["output_ids"]) == 32 for r in outs)
    after = stats(srv)
    assert after["counters"]["slots_released"] - before["counters"]["slots_released"] == 6 * (4000 - budget)
    assert after["kv_free_slots"] == after["kv_total_slots"]


def _prune_and_continue(srv, ids):
    generate(srv, ids, 1)
    free = stats(srv)["kv_free_slots"]
    rec = requests.post(srv.base_url + "/prune", timeout=600, json={
        "token_ids": ids, "ranges": [[100, 400]], "keep_tokens": 60, "policy": "kvzip", "wait": True}).json()
    assert (rec["status"], rec["retained_tokens"], rec["freed_slots"]) == ("completed", 60, 240), rec
    assert stats(srv)["kv_free_slots"] - free == 240
    out = generate(srv, ids + [5, 6, 7], 16)
    assert out["meta_info"]["cached_tokens"] >= 600
    s = stats(srv)
    assert s["integrity"]["ok"], s["integrity"]
    return out["output_ids"]


def test_prune_on_the_gpu_with_graphs_equals_eager(model, request):
    """/prune with dense on the Triton backend: the probe's scores are recorded, the pruned path
    frees exactly, and a request on it decodes the same tokens with CUDA graphs as eager (its
    RoPE offset reaches graph replay)."""
    ids = prompts(600, 1)[0]
    args = ["--model-path", model, *COMMON]
    graphs = start_server(args, request)
    with_graphs = _prune_and_continue(graphs, ids)
    graphs.stop()
    eager = start_server(args + ["--disable-cuda-graph"], request)
    assert _prune_and_continue(eager, ids) == with_graphs
    eager.stop()
