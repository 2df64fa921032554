"""Kernel launch tuning: ``sgl_kernel_sparse.tuning`` (per-device tables the wrappers consult for
options their caller left ``None``) and ``benchmark/gpu/tune_quest_kernels.py`` (the sweep that
writes them), the latter as a CPU smoke run under the Triton interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sgl_kernel_sparse import tuning

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def table(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    monkeypatch.setenv(tuning.ENV, str(path))
    tuning.clear_cache()
    yield path
    tuning.clear_cache()


def test_lookup_takes_the_largest_batch_key_not_above_the_batch(table):
    table.write_text(json.dumps({"_meta": {"device": "x"},
                                 "k": {"1": {"num_splits": 1}, "4": {"num_splits": 4},
                                       "16": {"num_splits": 16, "block_n": 64}}}))
    cpu = torch.device("cpu")
    got = [tuning.lookup("k", b, cpu).get("num_splits") for b in (1, 2, 3, 4, 8, 16, 64)]
    assert got == [1, 1, 1, 4, 4, 16, 16]
    assert tuning.lookup("k", 0, cpu) == {} and tuning.lookup("other", 4, cpu) == {}
    # an explicit argument wins; None takes the table's value; keys the table lacks stay None
    assert tuning.fill("k", 16, cpu, num_splits=None, block_n=32, num_warps=None) == {
        "num_splits": 16, "block_n": 32, "num_warps": None}


def test_no_file_a_broken_file_and_none_keep_the_heuristics(table, monkeypatch):
    cpu = torch.device("cpu")
    assert tuning.lookup("k", 4, cpu) == {}  # the named file does not exist
    table.write_text("{not json")
    tuning.clear_cache()
    with pytest.warns(UserWarning, match="ignoring kernel tuning file"):
        assert tuning.lookup("k", 4, cpu) == {}
    table.write_text(json.dumps({"k": {"1": {"a": 1}}}))
    monkeypatch.setenv(tuning.ENV, "none")
    tuning.clear_cache()
    assert tuning.lookup("k", 4, cpu) == {}
    assert tuning.config_name("NVIDIA H200") == "NVIDIA_H200.json"


def test_entries_a_kernel_cannot_launch_are_dropped_with_a_warning(table):
    table.write_text(json.dumps({"k": {"1": {"num_splits": 0}, "2": {"block_n": 24}, "3": {"num_warps": 6},
                                       "4": {"method": "heap"}, "5": {"prefetch": 1}, "8": {"colour": 1},
                                       "16": {"num_splits": 8, "block_n": 32, "prefetch": True, "method": "radix",
                                              "num_stages": 0, "num_warps": None}}}))
    cpu = torch.device("cpu")
    with pytest.warns(UserWarning, match=r"k\[1\] ignored: bad num_splits"):
        assert tuning.lookup("k", 8, cpu) == {}
    assert tuning.lookup("k", 16, cpu) == {"num_splits": 8, "block_n": 32, "prefetch": True, "method": "radix",
                                           "num_stages": 0, "num_warps": None}


def test_a_table_reaches_the_kernel_wrappers_and_explicit_options_win(table, monkeypatch):
    """select_top takes its method, warps and chunk from the table (keyed by rows) and an explicit
    ``method=`` over the table's; the launch is recorded instead of run."""
    from sgl_kernel_sparse import triton_select

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append((self.name, grid, kw))

    monkeypatch.setattr(triton_select, "_KERNELS", {"bits": Recorder("bits"), "radix": Recorder("radix")})
    monkeypatch.setattr(triton_select, "check_device", lambda *t: None)
    table.write_text(json.dumps({"select_top": {"2": {"method": "radix", "num_warps": 8, "chunk": 2048}}}))
    triton_select.select_top(torch.zeros(1, 64), 4)  # 1 row: below the entry's key, the defaults
    triton_select.select_top(torch.zeros(2, 64), 4)
    triton_select.select_top(torch.zeros(2, 64), 4, method="bits", num_warps=4)
    (n1, g1, kw1), (n2, g2, kw2), (n3, _, kw3) = launches
    assert (n1, kw1["num_warps"], kw1["CHUNK"]) == ("bits", 4, 64)
    assert (n2, g2, kw2["num_warps"], kw2["CHUNK"]) == ("radix", (2,), 8, 64)  # the chunk never exceeds the row
    assert (n3, kw3["num_warps"]) == ("bits", 4)


def test_tune_quest_kernels_smoke_run_writes_results_and_a_table(tmp_path):
    """The GPU tuning script on tiny shapes under the Triton interpreter: every stage swept, every
    config agrees with the default, the best per stage written in the tuning table's format."""
    out, cfg = tmp_path / "sweep.json", tmp_path / "table.json"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "sgl-kernel-sparse" / "python"), str(ROOT / "python"),
                                         env.get("PYTHONPATH", "")])
    res = subprocess.run([sys.executable, str(ROOT / "benchmark" / "gpu" / "tune_quest_kernels.py"), "--quick",
                          "--batch", "1", "--ctx", "256", "--budget", "48", "--layers", "1", "--rounds", "1",
                          "--reps", "1", "--out", str(out), "--write-config", str(cfg)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    result = json.loads(out.read_text())
    stages = result["batches"]["1"]["stages"]
    assert set(stages) == {"quest_page_scores_paged", "select_top", "select_top_kv", "paged_sparse_decode_attention",
                           "paged_gqa_decode_attention"}
    for rows in stages.values():
        assert len(rows) >= 2 and all(r["ok"] for r in rows), rows
        assert all(r["us"] > 0 for r in rows)
    assert set(result["batches"]["1"]["layer_us"]) == {"head_default", "head_tuned", "kv_head_default",
                                                       "kv_head_tuned"}
    written = json.loads(cfg.read_text())
    assert written["_meta"]["written_by"].endswith("tune_quest_kernels.py")
    # interpreter timings are noise, so which paths beat their defaults varies: the table is what
    # table_entries (tested on fixed figures below) makes of this run's measurements
    entries, dropped = tune_script().table_entries(result["batches"])
    assert {k: v for k, v in written.items() if k != "_meta"} == entries
    assert written["_meta"]["dropped"] == dropped
    assert len(dropped) + sum(len(v) for v in entries.values()) == 5  # 4 keys, scores counted once per path


def tune_script():
    sys.path.insert(0, str(ROOT / "benchmark" / "gpu"))
    try:
        import tune_quest_kernels
    finally:
        sys.path.pop(0)
    return tune_quest_kernels


def layer_us(head, kv_head):
    """Tuned / default microseconds per path."""
    return {"head_default": 100.0, "head_tuned": head, "kv_head_default": 100.0, "kv_head_tuned": kv_head}


BEST = {"quest_page_scores_paged": {"block_p": 32, "num_warps": 4}, "select_top": {"method": "nibble"},
        "select_top_kv": {"method": "bits", "num_warps": None}, "paged_sparse_decode_attention": {"num_splits": 16},
        "paged_gqa_decode_attention": {}}


def test_the_table_keeps_only_entries_of_a_layer_that_got_faster():
    """A path whose tuned layer is not faster than its defaults writes nothing, and takes the page
    scores it shares with the other path along; selection is keyed by rows (batch 1 per query head
    and batch 4 per KV head are both 32 rows: the first kept config wins)."""
    table_entries = tune_script().table_entries
    entries, dropped = table_entries({"4": dict(best=BEST, layer_us=layer_us(90.0, 80.0)),
                                      "1": dict(best=dict(BEST, select_top={"method": "radix"}),
                                                layer_us=layer_us(95.0, 99.0))})
    assert dropped == []
    assert entries == {"quest_page_scores_paged": {"4": BEST["quest_page_scores_paged"],
                                                   "1": BEST["quest_page_scores_paged"]},
                       "select_top": {"128": {"method": "nibble"}, "32": {"method": "bits"}, "8": {"method": "bits"}},
                       "paged_sparse_decode_attention": {"4": {"num_splits": 16}, "1": {"num_splits": 16}},
                       "paged_gqa_decode_attention": {"4": {}, "1": {}}}

    entries, dropped = table_entries({"4": dict(best=BEST, layer_us=layer_us(90.0, 100.0))})  # kv_head: no gain
    assert entries == {"select_top": {"128": {"method": "nibble"}},
                       "paged_sparse_decode_attention": {"4": {"num_splits": 16}}}
    assert len(dropped) == 3 and all("per kv_head was not faster" in d for d in dropped), dropped
    assert any(d.startswith("quest_page_scores_paged[4]") for d in dropped)

    entries, dropped = table_entries({"2": dict(best=BEST, layer_us=layer_us(101.0, 120.0))})
    assert entries == {} and len(dropped) == 5  # the shared scores entry is named once


def test_tune_quest_kernels_refuses_a_table_from_a_partial_sweep(tmp_path):
    """``--stages`` leaves the other stages at their defaults, so a table from it would drop their
    entries: refused before anything is measured (no GPU or interpreter needed)."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmark" / "gpu" / "tune_quest_kernels.py"),
                          "--stages", "select_top", "--out", str(tmp_path / "o.json"),
                          "--write-config-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--stages writes no tuning table" in res.stderr, res.stderr
    assert not (tmp_path / "o.json").exists()
    res = subprocess.run([sys.executable, str(ROOT / "benchmark" / "gpu" / "tune_quest_kernels.py"),
                          "--stages", "select_bottom", "--out", str(tmp_path / "o.json")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "--stages ['select_bottom']: allowed" in res.stderr, res.stderr


def test_hbm_ceiling_by_device_name():
    """The benchmarks' % of HBM is against the GPU's own ceiling (bench_kernels.py once took the
    H200's 4.8 TB/s on an H100); an unknown GPU has none (the benchmark then asks for it)."""
    from sgl_kernel_sparse.tuning import hbm_tbps

    assert hbm_tbps("NVIDIA H100 80GB HBM3") == 3.35
    assert hbm_tbps("NVIDIA H200") == 4.8
    assert hbm_tbps("NVIDIA A100-SXM4-80GB") is None
