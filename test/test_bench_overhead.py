"""The overhead figures' arithmetic: bench_overhead's order-balanced combination of runs and
profile_decode's per-step summary of a torch-profiler trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_overhead as O  # noqa: E402
import profile_decode as P  # noqa: E402


def _run(tmp_path, name, first, plain, sparse):
    path = tmp_path / name
    path.write_text(json.dumps({"settings": {"first": first}, "median": {
        "sglang": {"decode_tok_s@1": plain, "ttft_s": 1.0},
        "sglang_sparse": {"decode_tok_s@1": sparse, "ttft_s": 1.1}}}))
    return str(path)


def test_combine_cancels_the_start_order(tmp_path):
    # the first-started server is 10% faster in each run: the variant itself costs nothing
    a = _run(tmp_path, "a.json", "sglang", 110.0, 100.0)
    b = _run(tmp_path, "b.json", "sglang_sparse", 100.0, 110.0)
    out = tmp_path / "both.json"
    O.combine([a, b], str(out))
    table = json.loads(out.read_text())["sparse_over_plain"]
    assert table["decode_tok_s@1"]["geomean"] == pytest.approx(1.0)
    assert table["decode_tok_s@1"]["overhead"] == pytest.approx(0.0)
    assert table["ttft_s"]["overhead"] == pytest.approx(0.1)  # + = sparse slower
    assert json.loads(out.read_text())["first"] == ["sglang", "sglang_sparse"]


def test_combine_keeps_a_real_cost(tmp_path):
    a = _run(tmp_path, "a.json", "sglang", 100.0, 95.0)
    b = _run(tmp_path, "b.json", "sglang_sparse", 100.0, 95.0)
    out = tmp_path / "both.json"
    O.combine([a, b], str(out))
    assert json.loads(out.read_text())["sparse_over_plain"]["decode_tok_s@1"]["overhead"] == pytest.approx(0.05)


def _x(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_profile_summary_per_step():
    # two steps of 1,000 us: kernels busy 600 us each (one overlap counted once), 400 us host gap
    events = [
        _x("kernel", "gemm", 0, 500), _x("kernel", "attn", 400, 200),  # union 0..600
        _x("kernel", "gemm", 1000, 500), _x("kernel", "attn", 1400, 600),  # union 1000..2000
        _x("cpu_op", "aten::mm", 0, 50), _x("cuda_runtime", "cudaGraphLaunch", 0, 10),
        {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5},  # not a span: ignored
    ]
    s = P.summarize({"traceEvents": events}, steps=2, top=10)
    assert s["step_ms"] == pytest.approx(1.0)
    assert s["gpu_busy_ms"] == pytest.approx((600 + 1000) / 1000 / 2)
    assert s["kernels_per_step"] == 2
    gemm = next(r for r in s["kernels"] if r["name"] == "gemm")
    assert gemm["per_step"] == 1 and gemm["us_per_step"] == 500
    assert s["kernels"][0]["name"] == "gemm"  # sorted by time
    assert {r["name"] for r in s["cpu_ops"]} == {"aten::mm", "cudaGraphLaunch"}
    assert s["busy_source"] == "gpu kernels"
    assert s["idle_gaps_ms"] == [pytest.approx(0.4)]  # 600..1000; the overlap 400..500 is no gap
    assert P.idle_gaps_ms([(0, 10), (30, 40), (100, 110), (5, 20)]) == [pytest.approx(0.06), pytest.approx(0.01)]
    cpu_only = P.summarize({"traceEvents": [_x("cpu_op", "aten::mm", 0, 50)]}, steps=1, top=10)
    assert cpu_only["busy_source"].startswith("cpu ops")  # a CPU server's figure is not called GPU time


def test_profile_variants_launch_flags():
    assert P.variant_launch("plain", {}) == ("sglang.launch_server", [])
    assert P.variant_launch("dense", {}) == ("sglang_sparse.launch_server", [])
    assert P.variant_launch("omnikv", {}) == ("sglang_sparse.launch_server", ["--sparse-method", "omnikv"])
    own = P.parse_variant_flags(["omnikv=--sparse-method omnikv --sparse-token-budget 512"])
    assert P.variant_launch("omnikv", own) == (
        "sglang_sparse.launch_server", ["--sparse-method", "omnikv", "--sparse-token-budget", "512"])
    with pytest.raises(SystemExit, match="NAME="):
        P.parse_variant_flags(["omnikv"])


def test_profile_prompts_share_no_prefix():
    prompts = P.prompts_for(4, 64)
    assert all(len(p) == 64 for p in prompts)
    assert len({p[0] for p in prompts}) == 4  # distinct first tokens: no radix hit between them
