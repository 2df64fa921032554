"""R-KV's redundancy read from the pool (``sgl_kernel_sparse.triton_rkv``, what an eviction wave
runs per layer on CUDA) against the reference (``eviction_scores.rkv_redundancy_rows``: the keys
gathered, then ``rkv_redundancy``, itself checked against the cosine-matrix form in
``test_online_eviction.py``).

CPU, default suite: the kernel under the Triton interpreter in one subprocess (``python
test_rkv_redundancy_kernel.py --interp``): requests at scattered slots of the pool, row counts
that are not a multiple of the tile, one row, a zero key, a padded head dim, fp32 / bf16, and the
refusals; and the kernel compiled for sm_90 without a GPU. GPU (``-m gpu``): a wave of 15 requests at R-KV's capacity shape (2,176 rows, 8 KV
heads, d 128, bf16) against the reference, timed next to it (printed, not asserted); the same
over every layer of a flat pool in one launch (``rkv_redundancy_layers``), timed next to a launch
per layer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "sgl-kernel-sparse" / "python") not in sys.path:  # the package from the checkout
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "python"))

from sgl_kernel_sparse import dispatch, eviction_scores  # noqa: E402

from interpreter_cases import compile_report_rows, interpreter_test, report, run_cases  # noqa: E402


def wave(r, n, hkv, d, dtype, seed):
    """``r`` requests of ``n`` rows each at distinct, scattered slots of a pool layer (never slot 0)."""
    g = torch.Generator().manual_seed(seed)
    total = r * n + 9
    k_cache = (torch.randn(total + 1, hkv, d, generator=g) * 3).to(dtype)
    slots = (torch.randperm(total, generator=g)[: r * n] + 1).view(r, n)
    return k_cache, slots


def close(got, want, dtype, what=""):
    # fp32 sums in another order; the softmax over n rows brings values near 1 / n
    torch.testing.assert_close(got, want, rtol=1e-4 if dtype != torch.float32 else 2e-5, atol=1e-7,
                               msg=lambda m: f"{what}: {m}")


def case_matches_reference(T):
    for r, n, hkv, d, dtype in [(3, 37, 2, 16, torch.float32), (2, 130, 4, 24, torch.bfloat16),
                                (1, 1, 1, 8, torch.float32), (4, 64, 2, 32, torch.bfloat16)]:
        k_cache, slots = wave(r, n, hkv, d, dtype, seed=r * n)
        k_cache[slots[0, min(3, n - 1)], 0] = 0.0  # a zero key: similarity 0, no NaN
        got = T.rkv_redundancy_rows(k_cache, slots)
        want = eviction_scores.rkv_redundancy_rows(k_cache, slots)
        assert got.shape == (r, hkv, n) and got.dtype == torch.float32, got.shape
        assert not torch.isnan(got).any()
        close(got, want, dtype, f"r={r} n={n} hkv={hkv} d={d} {dtype}")
        for block_n in (16, 32):  # several tiles and a ragged last one
            close(T.rkv_redundancy_rows(k_cache, slots, block_n=block_n), want, dtype, f"block_n={block_n}")


def case_int32_slots_and_a_strided_table(T):
    """SGLang's slot table is int32, and a wave's slots are rows of a wider table."""
    k_cache, slots = wave(3, 50, 2, 16, torch.float32, seed=5)
    wide = torch.zeros(3, 80, dtype=torch.int32)
    wide[:, :50] = slots.to(torch.int32)
    close(T.rkv_redundancy_rows(k_cache, wide[:, :50]), eviction_scores.rkv_redundancy_rows(k_cache, slots),
          torch.float32)


def flat_wave(r, n, layers, hkv, d, dtype, seed):
    """A flat pool of ``layers`` parts (``[layers * S, Hkv, D]``) and ``r`` requests' slots in it."""
    g = torch.Generator().manual_seed(seed)
    per_layer = r * n + 5
    flat = (torch.randn(layers * per_layer, hkv, d, generator=g) * 3).to(dtype)
    slots = (torch.randperm(per_layer - 1, generator=g)[: r * n] + 1).view(r, n)
    return flat, slots, per_layer


def case_every_layer_in_one_launch(T):
    """``rkv_redundancy_layers`` over a flat pool equals the reference and, layer by layer, the
    one-layer kernel on that layer's part."""
    for r, n, layers, hkv, d, dtype in [(3, 37, 4, 2, 16, torch.float32), (2, 70, 3, 3, 24, torch.bfloat16)]:
        flat, slots, per_layer = flat_wave(r, n, layers, hkv, d, dtype, seed=n)
        got = T.rkv_redundancy_layers(flat, slots, layers, block_n=16)
        assert got.shape == (r, layers, hkv, n) and got.dtype == torch.float32, got.shape
        close(got, eviction_scores.rkv_redundancy_layers(flat, slots, layers), dtype, f"layers={layers} {dtype}")
        for layer in range(layers):
            part = flat[layer * per_layer: (layer + 1) * per_layer]
            close(got[:, layer], T.rkv_redundancy_rows(part, slots, block_n=16), dtype, f"layer {layer}")
    try:
        T.rkv_redundancy_layers(flat[:-1], slots, layers)
    except ValueError as exc:
        assert "must be [layers * S, Hkv, D]" in str(exc), str(exc)
    else:
        raise AssertionError("a pool that does not split into the layers was not refused")


def case_refusals(T):
    k_cache, slots = wave(2, 10, 2, 16, torch.float32, seed=1)
    for bad in (dict(k_cache=k_cache[:, 0], slots=slots), dict(k_cache=k_cache, slots=slots[0])):
        try:
            T.rkv_redundancy_rows(**bad)
        except ValueError as exc:
            assert "must be [S, Hkv, D] and slots [R, n]" in str(exc), str(exc)
        else:
            raise AssertionError(f"no refusal for {[tuple(v.shape) for v in bad.values()]}")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    from sgl_kernel_sparse.triton_rkv import rkv_redundancy_layers, rkv_redundancy_rows

    return run_cases(CASES, SimpleNamespace(rkv_redundancy_rows=rkv_redundancy_rows,
                                            rkv_redundancy_layers=rkv_redundancy_layers))


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_dispatch_runs_the_reference_on_the_cpu():
    """Off CUDA the dispatch is the reference: the gathered keys' redundancy, request by request."""
    k_cache, slots = wave(3, 20, 2, 8, torch.float32, seed=3)
    got = dispatch.rkv_redundancy_rows(k_cache, slots)
    for r in range(3):
        torch.testing.assert_close(got[r], eviction_scores.rkv_redundancy(k_cache[slots[r]].transpose(0, 1)))


def _compile_report(out: str) -> None:
    """Subprocess side (``--compile-report OUT``): the ahead-of-time compile for sm_90 at the 8B
    shape, bf16 and fp32 keys; the report as JSON."""
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "bench"))
    import compile_report as C
    from sgl_kernel_sparse.triton_rkv import rkv_redundancy_rows

    def exercise(dtypes):
        for dt in dtypes:
            k_cache, slots = wave(2, 300, 8, 128, dt, 0)
            rkv_redundancy_rows(k_cache, slots)

    C.EXERCISE["rkv_redundancy"] = exercise
    Path(out).write_text(json.dumps(C.compile_all(90, ["bf16", "fp32"], ["rkv_redundancy"])))


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot see: the kernel compiles for an H100 / H200 (sm_90), no spills."""
    rows = compile_report_rows(__file__, tmp_path / "report.json")
    assert len(rows) == 2 and {r["kernel"] for r in rows} == {"_rkv_mean_similarity_kernel"}, rows
    assert all(r["spill_bytes"] == 0 for r in rows), rows


@pytest.mark.gpu
def test_gpu_rkv_redundancy_rows():
    """A wave batch at the capacity shape equals the reference; timed next to it (one layer)."""
    k_cache, slots = wave(15, 2176, 8, 128, torch.bfloat16, seed=7)
    k_cache, slots = k_cache.cuda(), slots.cuda()
    timings, outs = {}, {}
    for name, fn in [("reference", eviction_scores.rkv_redundancy_rows), ("triton", dispatch.rkv_redundancy_rows)]:
        outs[name] = fn(k_cache, slots).cpu()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn(k_cache, slots)
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / 20
    print(f"rkv_redundancy_rows 15 x 2,176 rows, 8 KV heads, d 128, bf16: reference (gather + torch) "
          f"{timings['reference']:.3f} ms, kernel {timings['triton']:.3f} ms (one layer)")
    close(outs["triton"], outs["reference"], torch.bfloat16, "capacity shape")


@pytest.mark.gpu
def test_gpu_rkv_redundancy_over_flat_cells_of_every_layer():
    """A wave batch at the capacity shape over all 36 layers of a flat pool: one launch equals the
    reference; timed next to 36 one-layer launches (printed, not asserted)."""
    flat, slots, per_layer = flat_wave(15, 2176, 36, 8, 128, torch.bfloat16, seed=8)
    flat, slots = flat.cuda(), slots.cuda()
    layers = [flat[i * per_layer: (i + 1) * per_layer] for i in range(36)]
    runs = {"one launch": lambda: dispatch.rkv_redundancy_layers(flat, slots, 36),
            "36 launches": lambda: torch.stack([dispatch.rkv_redundancy_rows(k, slots) for k in layers], dim=1)}
    got = runs["one launch"]().cpu()
    close(got, eviction_scores.rkv_redundancy_layers(flat, slots, 36).cpu(), torch.bfloat16, "capacity shape")
    timings = {}
    for name, fn in runs.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / 5
    print(f"rkv redundancy, 15 x 2,176 rows x 36 layers, 8 KV heads, d 128, bf16: {timings} (ms per batch)")


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
elif __name__ == "__main__" and "--compile-report" in sys.argv:
    _compile_report(sys.argv[sys.argv.index("--compile-report") + 1])
