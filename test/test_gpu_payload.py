"""Issue 14's methods on the CUDA path (GPU machine only; skipped elsewhere), through real servers
on the default model's shape with random weights (see test_gpu_server.py):

- StreamingLLM evicts while decoding inside SGLang's decode CUDA graphs (compaction at the safe
  point, between graph replays) and gives the eager tokens; kv_bytes_used stays bounded;
- PyramidKV compacts per layer on the flat GPU pool (one Triton ``compact_kv`` over every layer)
  and decodes over per-layer cells through the Triton cells kernel inside the decode CUDA graphs
  (no Python per decode layer once captured), with the eager tokens; a chain resumes over them;
  every slot comes back;
- KIVI decodes through the Triton kernel inside the decode CUDA graphs, with the eager tokens,
  and frees every block and slot;
- TurboQuant likewise, through its own Triton kernel (issue 17);
- RetroInfer (issue 15) decodes eagerly through its pinned host tier and device cluster cache;
  with every cluster retrieved its tokens equal dense's (fp32)."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import free_and_used, start_server

pytestmark = pytest.mark.gpu

COMMON = ["--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
          "--max-total-tokens", "65536", "--log-level", "warning"]


@pytest.fixture(scope="module")
def model():
    path = os.environ.get("SGLANG_SPARSE_GPU_MODEL", ".gpumodel/smollm2-135m")
    if not os.path.isdir(path):
        pytest.skip(f"no model config at {path} (benchmark/gpu/prepare.sh makes it)")
    return path


def prompts(n_tokens: int, count: int) -> list[list[int]]:
    return [[1000 + (31 * i + 7 * j) % 30000 for j in range(n_tokens)] for i in range(count)]


def generate(srv, ids, n=16, chain_id=None) -> dict:
    sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    if chain_id:
        sp["custom_params"] = {"chain_id": chain_id}
    resp = requests.post(srv.base_url + "/generate", timeout=600, json={"input_ids": ids, "sampling_params": sp})
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(srv) -> dict:
    return requests.get(srv.base_url + "/sparse/stats", timeout=60).json()


def test_streamingllm_graphs_equal_eager_and_memory_stays_bounded(model, request):
    flags = ["--sparse-method", "streamingllm", "--sparse-sinks", "4", "--sparse-recent", "128",
             "--sparse-evict-every", "16", "--chain-cache", "off"]
    batch = prompts(1000, 4)
    graphs = start_server(["--model-path", model, *COMMON, *flags], request)
    got = [r["output_ids"] for r in generate(graphs, batch, n=300)]
    s = stats(graphs)
    assert s["kv_free_slots"] == s["kv_total_slots"] and s["integrity"]["ok"]
    assert s["counters"]["slots_released"] >= 4 * (1300 - 4 - 128 - 16)
    graphs.stop()
    eager = start_server(["--model-path", model, *COMMON, *flags, "--disable-cuda-graph"], request)
    assert [r["output_ids"] for r in generate(eager, batch, n=300)] == got


def graphs_equal_eager(model, request, flags, batch, n):
    """Generate ``batch`` on a server with decode CUDA graphs and on an eager one: the tokens agree
    and, once captured, the graph server ran no Python per decode layer."""
    graphs = start_server(["--model-path", model, *COMMON, *flags], request)
    before = stats(graphs)
    got = generate(graphs, batch, n=n)
    after = stats(graphs)
    calls = [s["counters"].get("decode_layer_python_calls", 0) for s in (before, after)]
    assert calls[1] == calls[0], f"decode ran Python per layer under CUDA graphs: {calls}"
    graphs.stop()
    eager = start_server(["--model-path", model, *COMMON, *flags, "--disable-cuda-graph"], request)
    e_before = stats(eager)
    assert [r["output_ids"] for r in generate(eager, batch, n=n)] == [r["output_ids"] for r in got]
    assert stats(eager)["counters"]["decode_layer_python_calls"] > e_before["counters"].get(
        "decode_layer_python_calls", 0)  # the counter does count eager decode layers
    eager.stop()
    return got, before, after


def test_pyramidkv_decodes_in_graphs_compacts_per_layer_and_resumes_a_chain(model, request):
    budget = 256
    flags = ["--sparse-method", "pyramidkv", "--sparse-budget", str(budget)]
    outs, before, after = graphs_equal_eager(model, request, [*flags, "--chain-cache", "off"],
                                             prompts(4000, 4), 32)
    assert all(len(r["output_ids"]) == 32 for r in outs)
    released = after["counters"]["slots_released"] - before["counters"]["slots_released"]
    assert released >= 0.9 * 4 * (4000 - budget)  # what SnapKV at the same budget frees
    assert after["kv_free_slots"] == before["kv_free_slots"] and after["integrity"]["ok"]
    srv = start_server(["--model-path", model, *COMMON, *flags], request)  # chains on
    start = stats(srv)
    p1 = prompts(3000, 1)[0]
    o1 = generate(srv, p1, 8)
    cid = o1["meta_info"]["chain_id"]
    o2 = generate(srv, p1 + o1["output_ids"] + prompts(200, 2)[1], 8, cid)
    assert (o2["meta_info"]["chain_status"], o2["meta_info"]["reused_tokens"]) == ("resumed", 3007)
    requests.delete(f"{srv.base_url}/chain/{cid}", timeout=60)
    end = stats(srv)
    assert end["kv_free_slots"] == start["kv_free_slots"] and end["integrity"]["ok"]


def test_kivi_decodes_in_graphs_through_the_triton_kernel_and_frees_every_block(model, request):
    flags = ["--sparse-method", "kivi", "--sparse-bits", "2", "--sparse-group", "32", "--sparse-residual", "64"]
    outs, before, after = graphs_equal_eager(model, request, flags, prompts(3000, 4), 100)
    assert all(len(r["output_ids"]) == 100 for r in outs)
    written = after["counters"]["kivi_blocks_written"] - before["counters"].get("kivi_blocks_written", 0)
    assert written >= 4 * (3100 - 64 - 32) // 32
    # what is still held: the radix cache's blocks (finished requests' history) and the idle
    # chains' residual rows (each request parks its chain)
    assert free_and_used(after) == free_and_used(before)
    assert after["kv_bytes_per_token"] * 5 < after["kv_bytes_per_slot"]


def kivi_reuse(srv, first, second):
    """Two turns on one server: ``first`` finishes (its blocks go to the radix cache and its chain
    parks), a continuation resumes the chain, then a new request sharing ``first``'s head starts
    on the cached blocks. Returns the tokens of the three and the reuse figures."""
    o1 = generate(srv, first, 16)
    cid = o1["meta_info"]["chain_id"]
    o2 = generate(srv, first + o1["output_ids"] + second, 32, cid)
    o3 = generate(srv, first[:2000] + second, 32)
    requests.delete(f"{srv.base_url}/chain/{cid}", timeout=60)
    requests.delete(f"{srv.base_url}/chain/{o2['meta_info']['chain_id']}", timeout=60)
    requests.delete(f"{srv.base_url}/chain/{o3['meta_info']['chain_id']}", timeout=60)
    assert requests.post(srv.base_url + "/flush_cache", timeout=60).status_code == 200
    return ([o["output_ids"] for o in (o1, o2, o3)],
            (o2["meta_info"]["chain_status"], o2["meta_info"]["reused_tokens"], o3["meta_info"]["cached_tokens"]))


def test_kivi_resumes_a_chain_and_reuses_cached_blocks_with_graphs_as_eager(model, request):
    """KIVI's two reuse paths on the GPU (the prefill attends dequantized blocks through
    ``prefix_kv``): a chain continuation and a radix-cache hit give the same tokens with decode
    CUDA graphs as eager, and every slot and block comes back after the flush."""
    flags = ["--sparse-method", "kivi", "--sparse-bits", "4", "--sparse-group", "32", "--sparse-residual", "64"]
    first, second = prompts(3000, 2)[0], prompts(200, 2)[1]
    runs = []
    for extra in ([], ["--disable-cuda-graph"]):
        srv = start_server(["--model-path", model, *COMMON, *flags, *extra], request)
        before = stats(srv)
        runs.append(kivi_reuse(srv, first, second))
        after = stats(srv)
        assert after["radix"]["evictable_units"] == 0 and free_and_used(after) == free_and_used(before)
        assert after["integrity"]["ok"]
        srv.stop()
    (graph_tokens, figures), (eager_tokens, eager_figures) = runs
    assert figures == eager_figures == ("resumed", 3015, 2000 // 32 * 32), figures
    assert graph_tokens == eager_tokens


def test_turboquant_decodes_in_graphs_through_the_triton_kernel_and_frees_every_block(model, request):
    """TurboQuant (issue 17) on the CUDA path: the method starts on CUDA, decodes through
    ``triton_turboquant`` inside the decode CUDA graphs with eager's tokens (3 bits: codes that
    straddle bytes), writes its blocks and frees every block and slot."""
    flags = ["--sparse-method", "turboquant", "--sparse-bits", "3", "--sparse-group", "32",
             "--sparse-residual", "64"]
    outs, before, after = graphs_equal_eager(model, request, flags, prompts(3000, 4), 100)
    assert all(len(r["output_ids"]) == 100 for r in outs)
    written = after["counters"]["turboquant_blocks_written"] - before["counters"].get("turboquant_blocks_written", 0)
    assert written >= 4 * (3100 - 64 - 32) // 32
    assert free_and_used(after) == free_and_used(before)
    assert after["kv_bytes_per_token"] * 4 < after["kv_bytes_per_slot"]


def test_retroinfer_serves_on_cuda_through_its_pinned_host_tier(model, request):
    """RetroInfer (issue 15) on the CUDA path, eager decode (``--disable-cuda-graph``): after the
    prompt the cold rows move to pinned host memory and their slots go back to SGLang; decode
    fetches the retrieved clusters through the device page cache (256K rows: every step's 16
    clusters per query head fit, all of them do not). fp32 on both sides: with every cluster
    retrieved its tokens equal dense eager's; with 16 clusters per query head it decodes from
    cache hits as well as misses; host rows, cached pages and slots all come back."""
    base = ["--model-path", model, *COMMON, "--dtype", "float32", "--disable-cuda-graph"]
    retro = ["--sparse-method", "retroinfer", "--sparse-sinks", "4", "--sparse-local", "64",
             "--sparse-tokens-per-cluster", "16", "--sparse-segment", "2048", "--sparse-cache-rows", str(2 ** 18)]
    batch = prompts(3000, 2)
    dense = start_server(base, request)
    want = [r["output_ids"] for r in generate(dense, batch, n=16)]
    dense.stop()
    for retrieve, exact in ((1000, True), (16, False)):
        srv = start_server([*base, *retro, "--sparse-retrieve", str(retrieve)], request)
        got = [r["output_ids"] for r in generate(srv, batch, n=16)]
        s = stats(srv)
        assert all(len(g) == 16 for g in got)
        if exact:
            assert got == want
        cache = s["tiers"]["device_cache"]
        assert cache["misses"] > 0 and (exact or cache["hits"] > 0), cache
        assert s["tiers"]["host_bytes_peak"] > 0 and s["host_bytes_used"] == 0
        assert s["kv_free_slots"] == s["kv_total_slots"] and s["integrity"]["ok"]
        srv.stop()
