"""bench_long_context.py's tuning: the reported figure per batch is the best of the sweep, and the
sweep is kept (a baseline reported at a worse split count would inflate every ratio)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_long_context as B  # noqa: E402


def test_pick_best_keeps_the_fastest_split_per_batch_and_the_whole_sweep():
    runs = {
        16: {"kv": {"kv_bytes_per_token": 2}, "1": {"batch": 1, "decode_tok_s": 50.0},
             "4": {"batch": 4, "decode_tok_s": 150.0}},
        32: {"1": {"batch": 1, "decode_tok_s": 60.0}, "4": {"batch": 4, "decode_tok_s": float("nan")}},
        64: {"error": "RuntimeError('start')"},
    }
    best = B.pick_best(runs)
    assert best["1"]["decode_tok_s"] == 60.0 and best["1"]["kv_splits"] == 32
    assert best["4"]["decode_tok_s"] == 150.0 and best["4"]["kv_splits"] == 16  # NaN ranks last
    assert best["tuning"]["best"] == {"1": 32, "4": 16}
    sweep = best["tuning"]["sweep"]
    assert sweep["16"] == {"1": 50.0, "4": 150.0} and math.isnan(sweep["32"]["4"])
    assert sweep["64"] == {"error": "RuntimeError('start')"}
    assert best["kv"] == {"kv_bytes_per_token": 2}


def test_a_variants_own_split_values_replace_the_shared_sweep():
    args = type("A", (), {"tune": ["dense"], "kv_splits": [16, 32], "kv_splits_for": ["rkv=4", "quest=8,16"]})()
    assert B.split_sweep("dense", args) == [16, 32]
    assert B.split_sweep("rkv", args) == [4]  # not tuned, but its own value is passed
    assert B.split_sweep("quest", args) == [8, 16]
    assert B.split_sweep("snapkv", args) == [None]  # SGLang's default: no flag
    args.tune = ["dense", "rkv"]
    assert B.split_sweep("rkv", args) == [4]  # its own list wins over the shared sweep
    args.kv_splits_for = ["rkv=four"]
    try:
        B.split_sweep("rkv", args)
    except SystemExit as e:
        assert "rkv=four" in str(e) and "METHOD=N" in str(e)
    else:
        raise AssertionError("a malformed --kv-splits-for passed")


def test_splits_for_a_variant_not_run_is_refused():
    args = type("A", (), {"kv_splits_for": ["rkv=4"]})()
    B.check_splits_for(args, ["rkv", "dense"])  # named and run: fine
    try:
        B.check_splits_for(args, ["dense"])
    except SystemExit as e:
        assert "'rkv' is not among the variants run" in str(e) and "--methods dense" in str(e)
    else:
        raise AssertionError("--kv-splits-for naming a variant not run passed")


class _Args:
    pool, prompt_len, output_len, budget = 49152, 32768, 2048, 2048

    def __init__(self, extra):
        self.extra = extra


def test_h2o_capacity_counts_eviction_between_chunks_as_the_oracle_admits():
    """The bench's batch for H2O = what the MemoryOracle admits: the request being prefilled on
    budget + interval + one chunk rows, every other one on budget + interval."""
    from sglang_sparse.core.memory_oracle import MemoryOracle

    cap = _Args.budget + B.ONLINE_INTERVAL["h2o"]
    oracle = MemoryOracle(retained_budget=_Args.budget, row_cap=cap, prefill_cap=cap)
    held = oracle.chunked_prefill_rows(_Args.prompt_len, 8192)
    assert held == cap + 8192
    assert B.capacity_batch("h2o", _Args(["--chunked-prefill-size", "8192"])) == (_Args.pool - held) // cap + 1 == 19
    # without a known chunk size the prompt is counted whole (as for R-KV and SkipKV)
    assert B.capacity_batch("h2o", _Args([])) == B.capacity_batch("rkv", _Args([])) == 8
    assert B.capacity_batch("skipkv", _Args(["--chunked-prefill-size", "8192"])) == 19  # the same cap as H2O
    assert B.capacity_batch("rkv", _Args(["--chunked-prefill-size", "8192"])) == 8  # holds its prompt whole


def test_graphs_own_batch_captures_only_the_servers_batch():
    """--graphs-own-batch: a capacity server captures decode graphs for its own batch, after (so
    instead of) the list given after ``--``; without it, or for matched runs, the flags pass as given."""
    args = _Args(["--chunked-prefill-size", "8192", "--cuda-graph-bs-decode", "1", "2", "4"])
    args.experiment, args.graphs_own_batch = "capacity", True
    got = B.server_extra(args, 64, [19])
    assert got[:6] == args.extra and got[6:] == ["--triton-attention-num-kv-splits", "64", "--cuda-graph-bs-decode", "19"]
    from sglang.srt.server_args import ServerArgs
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m", *got]).cuda_graph_bs_decode == [19]  # the last one wins
    args.graphs_own_batch = False
    assert B.server_extra(args, None, [19]) == args.extra
    args.experiment, args.graphs_own_batch = "matched", True
    assert B.server_extra(args, None, [1, 2]) == args.extra


def test_every_agent_replay_variant_is_a_valid_server_configuration():
    import bench_agent_replay as R
    from sglang_sparse.srt.launcher import sparse_config

    for name in ["dense+radix", "dense+prune@0.2", *(f"{m}{c}" for m in ["snapkv", "pyramidkv", "h2o", "rkv",
                                                                         "skipkv", "streamingllm", "kvzip"]
                                                    for c in ["", "+chain"])]:
        flags = R.variant_flags(name, 256)
        config, _ = sparse_config(["--model-path", "m", "--device", "cpu", *flags], log=lambda m: None)
        if "+" in name and not name.startswith("dense"):
            assert config["method"] == name.split("+")[0] and config["chain_cache"] is True, name
    import pytest

    with pytest.raises(ValueError, match="unknown variant"):
        R.variant_flags("snapkv+radix", 256)


def test_agent_replay_merge_keeps_the_fastest_dense_of_every_file_and_every_failed_config(tmp_path):
    """A dense sweep that needs several GPU calls is merged: the fastest run of all files is the
    baseline, and a configuration that failed (e.g. a compiled server that did not start) stays
    in ``tuning`` under its own name instead of vanishing."""
    import json

    import bench_agent_replay as A

    settings = {"sessions": 2, "turns": 3, "system": 8, "tool_output": 4, "answer": 2, "tool_wait": 0,
                "budget": 4}

    def run(wall, splits, compiled=False):
        return {"wall_s": wall, "errors": [], "kv_splits": splits, "torch_compile": compiled}

    files = {
        "a.json": {"settings": {**settings, "kv_splits": [16, 32]}, "tuning": {"dense+radix": {"16": 30.0, "32": 25.0}},
                   "results": {"dense+radix": run(25.0, 32), "snapkv+chain": run(10.0, None)}},
        "b.json": {"settings": {**settings, "kv_splits": [8]}, "results": {"dense+radix": run(20.0, 8)}},
        "c.json": {"settings": {**settings, "compile_splits": [16], "kv_splits": []},
                   "results": {"dense+radix": {"error": "ServerStartError('not healthy')"}}},
    }
    paths = []
    for name, body in files.items():
        (tmp_path / name).write_text(json.dumps(body))
        paths.append(str(tmp_path / name))
    results, tuning, sources = A.merge(paths)
    assert results["dense+radix"]["wall_s"] == 20.0 and results["dense+radix"]["kv_splits"] == 8
    assert results["snapkv+chain"]["wall_s"] == 10.0
    assert tuning["dense+radix"] == {"a.json:32": 25.0, "a.json:16": 30.0, "b.json:8": 20.0,
                                     "c.json:16+compile": "ServerStartError('not healthy')"}
    assert set(sources) == {"a.json", "b.json", "c.json"}


def test_agent_replay_writes_its_json_after_every_run(tmp_path, monkeypatch):
    """A replay cut by the GPU call's limit (here: the second variant never returns) keeps what
    it measured: the JSON is rewritten after every run, not only at the end."""
    import json

    import bench_agent_replay as A

    def fake_run(name, args, splits, compiled):
        if name == "snapkv+chain":
            raise SystemExit("cut")  # not an Exception: the bench does not catch it, as a kill
        return {"wall_s": 10.0 + (splits or 0), "errors": [], "kv_splits": splits, "torch_compile": compiled}

    monkeypatch.setattr(A, "run_variant", fake_run)
    out = tmp_path / "replay.json"
    monkeypatch.setattr(sys, "argv", ["bench_agent_replay.py", "--variants", "dense+radix", "snapkv+chain",
                                      "--kv-splits", "16", "32", "--out", str(out)])
    try:
        A.main()
    except SystemExit:
        pass
    body = json.loads(out.read_text())
    assert body["results"]["dense+radix"]["wall_s"] == 26.0  # the best of the sweep so far
    assert body["tuning"]["dense+radix"] == {"16": 26.0, "32": 42.0} and "snapkv+chain" not in body["results"]


def test_quest_kv_variant_is_a_valid_gpu_server_with_one_page_set_per_kv_head():
    from sglang_sparse.srt.launcher import sparse_config

    _, flags = B.variant("quest-kv", 2048)
    config, argv = sparse_config(["--model-path", "m", "--device", "cuda", *B.GPU_FLAGS, *flags], log=lambda m: None)
    assert config["method"] == "quest" and config["options"]["select_per"] == "kv_head"
    assert config["options"]["token_budget"] == 2048 and argv[argv.index("--page-size") + 1] == "16"


def test_long_context_json_names_the_kernel_table_and_is_written_after_every_server(tmp_path, monkeypatch):
    """The servers inherit ``SGL_KERNEL_SPARSE_TUNING``; the JSON says which table they ran with,
    and a run cut after its first server (the second never returns) keeps that server's figures."""
    import json

    def fake_run(name, args, extra, batches, prompts, save, splits=None):
        if name == "quest":
            raise SystemExit("cut")  # a kill, not an error the bench records
        return {str(b): {"decode_tok_s": 10.0 * b, "peak_running": b} for b in batches}

    monkeypatch.setattr(B, "run_variant", fake_run)
    monkeypatch.setattr(B, "make_prompts", lambda n, length, seed=0: [[1] * 4] * n)
    monkeypatch.setenv("SGL_KERNEL_SPARSE_TUNING", "/tables/NVIDIA_H200.json")
    out = tmp_path / "matched.json"  # absolute: RESULTS / out is out
    monkeypatch.setattr(sys, "argv", ["bench_long_context.py", "matched", "--model-path", "m",
                                      "--methods", "dense", "quest", "--batches", "1", "4", "--out", str(out)])
    try:
        B.main()
    except SystemExit:
        pass
    body = json.loads(out.read_text())
    assert body["kernel_tuning_table"] == "/tables/NVIDIA_H200.json"
    assert body["results"] == {"dense": {"1": {"decode_tok_s": 10.0, "peak_running": 1},
                                         "4": {"decode_tok_s": 40.0, "peak_running": 4}}}


def test_overlap_variants_are_their_methods_under_the_overlap_scheduler():
    from sglang_sparse.srt.launcher import sparse_config

    for name, base in B.OVERLAP_OF.items():
        _, flags = B.variant(name, 2048)
        assert flags == B.variant(base, 2048)[1] + ["--sparse-overlap", "on"]
        config, argv = sparse_config(["--model-path", "m", "--device", "cuda", *B.GPU_FLAGS, *flags], log=lambda m: None)
        assert config["method"] == base and "--disable-overlap-schedule" not in argv
        args = _Args([])
        assert B.capacity_batch(name, args) == B.capacity_batch(base, args)  # the same rows resident
