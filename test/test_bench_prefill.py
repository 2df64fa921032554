"""bench_prefill.py (issue 17): every variant is a valid server configuration with the same chunk
and attention backend as dense, and the table's ratio is dense's TTFT over the variant's. The
counters it reads (``prefill_blocks_kept`` / ``prefill_blocks_total``, sparse / dense chunks) are
checked through a real server in ``test_flashprefill_server.py``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

import bench_long_context as LC  # noqa: E402
import bench_prefill as P  # noqa: E402


def _args(cpu: bool, min_len=None) -> argparse.Namespace:
    return argparse.Namespace(cpu=cpu, chunk=16384, flashprefill_min_len=min_len)


@pytest.mark.parametrize("cpu", [True, False])
def test_variants_are_valid_servers_with_dense_s_chunk_and_backend(cpu):
    from sglang_sparse.srt.launcher import sparse_config

    base = ["--model-path", "m", *(["--device", "cpu"] if cpu else ["--device", "cuda", *LC.GPU_FLAGS])]
    argvs = {}
    for name in ["dense", "flashprefill", "flashprefill@0.5"]:
        variant, extra = P.variant_flags(name, _args(cpu, 2048))
        _, flags = LC.variant(variant, 0)
        config, argv = sparse_config([*base, *flags, *extra], log=lambda m: None)
        argvs[name] = argv
        if name == "dense":
            assert config.get("prefill") is None
        else:
            opts = config["prefill"]["options"]
            assert config["prefill"]["name"] == "flashprefill" and config["method"] == "dense"
            assert opts["threshold"] == (0.5 if name.endswith("0.5") else 0.9) and opts["min_len"] == 2048
    for argv in argvs.values():  # the same chunk, backend and pages for every variant
        assert argv[argv.index("--chunked-prefill-size") + 1] == "16384"
        assert argv[argv.index("--attention-backend") + 1] == ("torch_native" if cpu else "triton")
        assert argv[argv.index("--page-size") + 1] == "16"
    with pytest.raises(SystemExit, match="unknown variant"):
        P.variant_flags("quest", _args(cpu))


def test_table_ratio_is_dense_ttft_over_the_variant_s():
    runs = [{"ttft_s": t, "kept_fraction": k, "prefill_sparse_chunks": 30, "prefill_dense_chunks": 0}
            for t, k in ((2.0, 0.25), (4.0, 0.35), (3.0, 0.3))]
    fp = P.summarize(runs, 6000)
    assert fp["ttft_s"] == 3.0 and fp["prefill_tok_s"] == 2000 and fp["kept_fraction"] == 0.3 and fp["n"] == 3
    dense = P.summarize([{"ttft_s": 6.0, "kept_fraction": None, "prefill_sparse_chunks": 0,
                          "prefill_dense_chunks": 0}], 6000)
    assert dense["kept_fraction"] is None
    rows = P.table({"dense": {"lengths": {"6000": dense}}, "flashprefill": {"lengths": {"6000": fp}}}, [6000])
    assert "1.00x" in rows[1] and "2.00x" in rows[2] and "30.0%" in rows[2]
