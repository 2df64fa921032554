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
