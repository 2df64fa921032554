"""Scaffolding shared by the quantized-KV decode kernel tests (``test_quant_kernels.py``,
``test_turboquant_kernel.py``, ``test_palu_kernel.py``): the NaN-poisoned block table, the
token-major residual pool, the non-contiguous query, and the output checks (tolerance,
zeros for empty requests).

Each builder draws from the caller's ``torch.Generator`` in the order its docstring gives, so a
test file calling them where it used to draw the same numbers inline builds the same inputs bit
for bit. Plain torch only: the interpreter subprocesses import this before triton."""

from __future__ import annotations

import torch

# (atol, rtol) per output dtype; a kernel file whose kernel rounds more passes its own table
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.6e-2, 2e-2)}


def block_table(g, b, n_req, n_blocks, poison):
    """``(table, req_rows)``: an int32 ``[n_req, max(n_blocks) + 2]`` block table in which every
    entry is ``poison`` (the NaN block) except the first ``n_blocks[i]`` of request i's row, which
    are distinct blocks from ``0 .. poison - 1`` in random order; ``req_rows`` (``[b]``) is the
    random table row of each request. Draws from ``g``: the rows, then the block order."""
    table = torch.full((n_req, max(n_blocks) + 2), poison, dtype=torch.int32)
    req_rows = torch.randperm(n_req, generator=g)[:b]
    order = torch.randperm(poison, generator=g).tolist()
    for i, nb in enumerate(n_blocks):
        table[req_rows[i], :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    return table, req_rows


def poison_slots_past(req_to_token, req_rows, lens, *pools):
    """Write NaN into each slot of every pool in ``pools`` that request i's row of
    ``req_to_token`` names past ``lens[i]``: slots a kernel must never read. Draws nothing."""
    for i, n in enumerate(lens):
        bad = req_to_token[req_rows[i], n:].long()
        for pool in pools:
            pool[bad] = float("nan")


def residual_pool(g, n_req, req_rows, res_lens, hkv, d, dtype):
    """``(k_cache, v_cache, req_to_token)``: a token-major residual pool, ``k_cache`` / ``v_cache``
    ``[slots, hkv, d]`` views into one fused ``[slots, 2, hkv, d]`` buffer in ``dtype`` (non-trivial
    strides, a few slots more than the table names), and a shuffled int64 ``req_to_token``
    ``[n_req, max(res_lens) + 4]`` whose entries past ``res_lens[i]`` in request i's row point to
    NaN slots. Draws from ``g``: the buffer, then the slot order."""
    ctx = max(res_lens) + 4
    num_slots = n_req * ctx + 5
    buf = torch.randn(num_slots, 2, hkv, d, generator=g).to(dtype)
    k_cache, v_cache = buf[:, 0], buf[:, 1]
    r2t = torch.randperm(num_slots, generator=g)[: n_req * ctx].view(n_req, ctx)
    poison_slots_past(r2t, req_rows, res_lens, k_cache, v_cache)
    return k_cache, v_cache, r2t


def strided_query(g, b, hq, d, dtype, scale=None):
    """A random ``[b, hq, d]`` query in ``dtype``, non-contiguous (the first ``d`` of ``2 * d``
    channels), times ``scale`` (in fp32, before the cast) when given. Draws from ``g`` once."""
    q = torch.randn(b, hq, 2 * d, generator=g)
    if scale is not None:
        q = q * scale
    return q.to(dtype)[..., :d]


def close(got, want, dtype, what, tol=TOL):
    """Assert that a kernel output ``got`` matches the reference ``want``: same dtype and shape, a
    reference free of NaN (it read no poisoned data), every element within ``atol + rtol * |want|``
    of ``tol[dtype]`` (NaN counts as off). ``what`` names the case in the message."""
    atol, rtol = tol[dtype]
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert not want.isnan().any(), f"{what}: the reference read poisoned data"
    err = (got.float() - want.float()).abs()
    bad = ~(err <= atol + rtol * want.float().abs())  # NaN counts as off
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} off, max err {err.max():.3g}"


def to_cuda(x):
    """A builder's dict with every tensor in it moved to the current CUDA device."""
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in x.items()}


def assert_empty_requests_zero(got, n_blocks, res_lens):
    """Each request with neither blocks nor residual rows must output zeros (``got[b]``)."""
    for b, (nb, nr) in enumerate(zip(n_blocks, res_lens)):
        if nb == 0 and nr == 0:
            assert (got[b] == 0).all(), "a request with nothing must output zeros"
