"""The decode-step scoring kernel (``sgl_kernel_sparse.triton_decode_scores``: every decode query's
attention added to the per-slot scores of H2O, SkipKV and R-KV) against the plain-torch reference
(``eviction_scores.decode_attention_add``, what ``core.slot_scores`` ran before the kernel and
still runs on the CPU).

CPU, default suite: the kernel under the Triton interpreter in one subprocess
(``python test_decode_scores_kernel.py --interp``), each ``case_*`` reported to its own pytest
test: requests of different lengths whose rows sit at scattered slots of the pool, in 1 to 5 row
splits (empty ones included), GQA 1 to 4 (3:
a group that is not a power of two), a padded head dim, fp32 / fp16 / bf16, weights (R-KV's buffer:
0, fractions, a bool mask), a captured batch's padding entry (slot 0), a table narrower than a
request's rows, one row, several key tiles, and the refusals. Scores start non-zero, so the own
slot's zeroing and the add on top of what was there are both checked. Also CPU: the kernel
compiled for sm_90 without a GPU. GPU (``-m gpu``): the compiled kernel at R-KV's capacity shape
(166 requests x 2,176 rows, 32 / 8 heads, d 128) against the reference, with every query counted
(H2O) and with 8 of every 128 counted (R-KV), timed next to the reference and the torch path it
replaced (printed, not asserted).
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


def step_inputs(n_rows, hq, hkv, d, dtype, seed, width=None, pad=0):
    """A decode batch: request b has ``n_rows[b]`` rows at distinct, scattered pool slots (never
    slot 0), its own table row (the table has spare rows; request b uses row ``2 b + 1``), the
    query of its last row. ``pad`` padding entries follow (slot 0, one row, as a captured batch
    pads). Returns the reference's arguments and a non-zero starting score table."""
    g = torch.Generator().manual_seed(seed)
    n_rows = list(n_rows)
    width = width or max(n_rows) + 5
    total = sum(n_rows) + 7
    k_cache = (torch.randn(total + 1, hkv, d, generator=g) * 2).to(dtype)
    perm = torch.randperm(total, generator=g) + 1  # slot 0 is SGLang's dummy slot
    table = torch.zeros(2 * (len(n_rows) + pad) + 1, width, dtype=torch.int32)
    req_rows, new_slots, used = [], [], 0
    for b, n in enumerate(n_rows):
        row = 2 * b + 1
        table[row, : min(n, width)] = perm[used: used + min(n, width)].to(torch.int32)
        used += n
        req_rows.append(row)
        new_slots.append(int(table[row, min(n, width) - 1]))
    for _ in range(pad):  # padding: a request of one row at slot 0 (SGLang's pad)
        req_rows.append(0)
        new_slots.append(0)
        n_rows.append(1)
    b = len(n_rows)
    q = (torch.randn(b, hq, d, generator=g) * 2).to(dtype)
    scores = torch.rand(total + 1, hkv, generator=g) + 0.5
    args = dict(q=q, k_cache=k_cache, req_to_token=table, req_rows=torch.tensor(req_rows, dtype=torch.int32),
                n_rows=torch.tensor(n_rows, dtype=torch.int32), new_slots=torch.tensor(new_slots))
    return scores, args


def close(got, want, dtype, what=""):
    # products exact in fp32 (fp16 / bf16 operands), only summation order and exp2 vs exp differ
    torch.testing.assert_close(got, want, rtol=2e-4 if dtype != torch.float32 else 1e-5, atol=1e-6,
                               msg=lambda m: f"{what}: {m}")


def _check(T, scores, args, dtype, what, **kw):
    want = scores.clone()
    eviction_scores.decode_attention_add(want, **args, **{k: v for k, v in kw.items() if k in ("weight", "scale")})
    got = scores.clone()
    T.decode_attention_add(got, **args, **kw)
    close(got, want, dtype, what)
    return got, want


def case_fp32_gqa4_scattered_rows(T):
    scores, args = step_inputs([70, 5, 33], 8, 2, 16, torch.float32, 1)
    got, _ = _check(T, scores, args, torch.float32, "fp32 gqa4", block_n=16)
    # each query's softmax sums to 1 over its rows for each of its heads: the scores rose by hq per query
    # (its own slot started at zero and is part of that), nothing else moved
    assert abs(float((got - scores).sum()) - (3 * 8 - float(scores[args["new_slots"]].sum()))) < 1e-3


def case_fp16_gqa2_d48_weights_and_padding(T):
    scores, args = step_inputs([40, 17, 64, 9], 4, 2, 48, torch.float16, 2, pad=2)
    weight = torch.tensor([0.5, 0.0, 2.0, 1.0, 1.0, 1.0])
    got, _ = _check(T, scores, args, torch.float16, "fp16 weighted", weight=weight, block_n=16)
    # request 1 (weight 0) and the padding only zeroed their own slot
    rows1 = args["req_to_token"][args["req_rows"][1], :17].long()
    assert float(got[rows1[-1]].abs().sum()) == 0.0
    torch.testing.assert_close(got[rows1[:-1]], scores[rows1[:-1]])


def case_bf16_gqa3_default_blocks(T):
    scores, args = step_inputs([130, 1, 77], 6, 2, 32, torch.bfloat16, 3)
    _check(T, scores, args, torch.bfloat16, "bf16 gqa3")


def case_mha_bool_weight_scale(T):
    """R-KV's weight is a bool mask (its buffer); a softmax scale other than 1/sqrt(d)."""
    scores, args = step_inputs([50, 50, 21], 3, 3, 16, torch.float32, 4)
    _check(T, scores, args, torch.float32, "bool weight", weight=torch.tensor([True, False, True]), scale=0.2,
           block_n=16)


def case_table_narrower_than_rows(T):
    """``SlotScores.add_decode`` passes the first ``width`` columns of the slot table: rows past
    them are not read (the method keeps ``n_rows <= width``; the kernel bounds it anyway)."""
    scores, args = step_inputs([60, 12], 4, 2, 16, torch.float32, 5, width=48)
    _check(T, scores, args, torch.float32, "narrow table", block_n=16)


def case_row_splits(T):
    """The rows of a request in 1 to 5 splits (the launch's S): splits past a short request's rows
    are empty and must not count in the merged sum; split boundaries inside and on key tiles."""
    for splits in (1, 2, 3, 5):
        scores, args = step_inputs([70, 5, 33, 16], 4, 2, 16, torch.float32, 8 + splits)
        _check(T, scores, args, torch.float32, f"{splits} splits", weight=torch.tensor([1.0, 0.5, 0.0, 2.0]),
               block_n=16, num_splits=splits)


def case_refusals(T):
    scores, args = step_inputs([10, 4], 4, 2, 16, torch.float32, 6)
    for bad, why in [(scores.half(), "fp32"), (scores[:, :1], "fp32 [S, 2]"), (scores.t().contiguous().t(), "rows")]:
        try:
            T.decode_attention_add(bad, **args)
        except ValueError as exc:
            assert why in str(exc), str(exc)
        else:
            raise AssertionError(f"no refusal for {why}")
    try:
        T.decode_attention_add(scores, **(args | dict(q=args["q"][:, :3])))
    except ValueError as exc:
        assert "multiple" in str(exc), str(exc)
    else:
        raise AssertionError("no refusal for 3 query heads over 2 KV heads")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


def _run_cases_here() -> dict:
    from sgl_kernel_sparse.triton_decode_scores import decode_attention_add

    return run_cases(CASES, SimpleNamespace(decode_attention_add=decode_attention_add))


test_triton_interpreter = interpreter_test(__file__, CASES)


def test_dispatch_runs_the_reference_on_the_cpu():
    """Off CUDA the dispatch is the reference (what the CPU server's H2O / SkipKV / R-KV call),
    and the reference is the formula: per query and KV head, the softmax over the request's rows
    summed over the group, times the weight, added at each row's slot."""
    scores, args = step_inputs([20, 7], 4, 2, 16, torch.float32, 7)
    weight = torch.tensor([1.0, 0.5])
    got = scores.clone()
    dispatch.decode_attention_add(got, **args, weight=weight)
    want = scores.clone()
    want[args["new_slots"]] = 0.0
    for b, (row, n) in enumerate(zip(args["req_rows"].tolist(), args["n_rows"].tolist())):
        slots = args["req_to_token"][row, :n].long()
        k = args["k_cache"][slots].float()  # [n, Hkv, D]
        for h in range(4):
            p = torch.softmax(k[:, h // 2] @ args["q"][b, h].float() / 4.0, dim=0)
            want[slots, h // 2] += weight[b] * p
    torch.testing.assert_close(got, want)


def _compile_report(out: str) -> None:
    """Subprocess side (``--compile-report OUT``): the ahead-of-time compile for sm_90 at the 8B
    shape (bf16 tensor-core dots; fp32 3xTF32), weighted or not; the report as JSON."""
    sys.path.insert(0, str(ROOT / "sgl-kernel-sparse" / "bench"))
    import compile_report as C
    from sgl_kernel_sparse.triton_decode_scores import decode_attention_add

    def exercise(dtypes):
        for dt in dtypes:
            scores, args = step_inputs([300, 200], 32, 8, 128, dt, 0)
            decode_attention_add(scores, **args)
            decode_attention_add(scores, **args, weight=torch.ones(2))

    C.EXERCISE["decode_scores"] = exercise
    Path(out).write_text(json.dumps(C.compile_all(90, ["bf16", "fp32"], ["decode_scores"])))


def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    """What the interpreter cannot see: the kernel compiles for an H100 / H200 (sm_90), weighted
    or not; no register spills on the bf16 path."""
    rows = compile_report_rows(__file__, tmp_path / "report.json")
    assert len(rows) == 8 and {r["kernel"] for r in rows} == {"_scores_logits_kernel", "_scores_add_kernel"}, rows
    served = [r for r in rows if r["constexprs"].get("DOT16", True)]  # bf16: what a bf16 model's server runs
    assert len(served) == 6 and all(r["spill_bytes"] == 0 for r in served), rows
    # fp32 logits (3xTF32 dots; tests and fp32 models): a few bytes spilled at most
    assert all(r["spill_bytes"] <= 64 for r in rows), rows


def _capacity_batch(dtype, counted_every):
    """R-KV at issue 15's capacity point: 166 requests of 2,048..2,176 rows, an 8B-shape layer
    (32 / 8 heads, d 128), in a pool of ~350K slots; ``counted_every``: one query in that many
    counts (1: H2O; 16: R-KV's 8 buffered queries of every 128)."""
    g = torch.Generator().manual_seed(11)
    n_rows = (2048 + torch.randint(0, 128, (166,), generator=g)).tolist()
    scores, args = step_inputs(n_rows, 32, 8, 128, dtype, 12, width=2176)
    weight = (torch.arange(166) % counted_every == 0).float()
    return scores, args, weight


def _before_the_kernel(scores, q, k_cache, req_to_token, req_rows, n_rows, new_slots, weight=None):
    """What ``SlotScores.add_decode`` ran on a GPU before this kernel (2026-12-06): OmniKV's Triton
    ``token_logits``, then the softmax, the group sum and a ``scatter_add_`` in torch."""
    b, hq, _ = q.shape
    hkv = scores.shape[1]
    logits = dispatch.token_logits(q, k_cache, req_to_token, req_rows, n_rows)
    probs = logits.softmax(dim=-1).view(b, hkv, hq // hkv, -1).sum(dim=2)
    probs = probs * ((new_slots != 0).to(probs.dtype) * weight.to(probs.dtype)).view(b, 1, 1)
    scores.index_fill_(0, new_slots.long(), 0.0)
    flat = req_to_token[req_rows.long()].long().unsqueeze(1) * hkv + torch.arange(hkv, device=q.device).view(1, hkv, 1)
    scores.view(-1).scatter_add_(0, flat.reshape(-1), probs.reshape(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("counted_every", [1, 16])
def test_gpu_decode_attention_add(counted_every):
    """The kernel equals the reference at the capacity shape; timed next to the reference and to
    the torch path it replaced (per layer; an 8B-shape step runs 36)."""
    scores, args, weight = _capacity_batch(torch.bfloat16, counted_every)
    cuda = {k: v.cuda() for k, v in args.items()}
    weight = weight.cuda()
    timings, outs = {}, {}
    for name, fn in [("reference", eviction_scores.decode_attention_add), ("before", _before_the_kernel),
                     ("triton", dispatch.decode_attention_add)]:
        out = scores.cuda()
        fn(out, **cuda, weight=weight)
        outs[name] = out.cpu()
        reps = 3 if name == "reference" else 50
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn(out, **cuda, weight=weight)  # in place: scores grow, the work is the same
        end.record()
        torch.cuda.synchronize()
        timings[name] = start.elapsed_time(end) / reps
    print(f"decode_attention_add 166 x ~2.1K rows, one query in {counted_every} counted: "
          f"plain-torch reference {timings['reference']:.3f} ms, before (Triton logits + torch) "
          f"{timings['before']:.3f} ms, kernel {timings['triton']:.3f} ms (one layer)")
    close(outs["triton"], outs["reference"], torch.bfloat16, f"one in {counted_every}")
    close(outs["before"], outs["reference"], torch.bfloat16, f"before, one in {counted_every}")


if __name__ == "__main__" and "--interp" in sys.argv:
    report(_run_cases_here())
elif __name__ == "__main__" and "--compile-report" in sys.argv:
    _compile_report(sys.argv[sys.argv.index("--compile-report") + 1])
