"""TurboQuant's MSE quantizer (``sgl_kernel_sparse.turboquant``) against its definition: the
codebook is the Lloyd-Max quantizer of a rotated unit vector's coordinate density (its error
matches the paper's D_mse at 1-4 bits and what random vectors measure), the rotation makes the
error independent of the vector's shape (outlier channels), codes pack to b bits per channel,
and attention with rotated queries over the codes equals attention over the dequantized K/V."""

from __future__ import annotations

import math

import pytest
import torch
from sgl_kernel_sparse import turboquant as tq

# Lloyd-Max error of a unit-variance Gaussian (Max, 1960), the large-dimension limit of D_mse
GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_is_lloyd_max_of_the_coordinate_density(bits):
    c = tq.codebook(bits, 128)
    assert c.shape == (1 << bits,) and bool((c[1:] > c[:-1]).all())
    assert torch.allclose(c, -c.flip(0), atol=0)  # symmetric
    # Lloyd's fixed point: each centroid is the mean of its cell (checked on an independent
    # Monte Carlo sample of the density: coordinates of rotated random unit vectors)
    g = torch.Generator().manual_seed(bits)
    y = torch.randn(20000, 128, generator=g, dtype=torch.float64)
    y = (y / y.norm(dim=1, keepdim=True)).flatten()
    cell = torch.bucketize(y, (c.double()[1:] + c.double()[:-1]) / 2)
    means = torch.stack([y[cell == i].mean() for i in range(1 << bits)])
    assert torch.allclose(means.float(), c, atol=2e-3 / math.sqrt(128) * (1 << bits)), (means, c)
    assert tq.expected_mse(bits, 128) == pytest.approx(GAUSSIAN_MSE[bits], rel=0.03)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_measured_error_is_the_expected_one_whatever_the_vectors(bits):
    d, g = 128, torch.Generator().manual_seed(7)
    rot, c = tq.rotation(d, seed=11), tq.codebook(bits, d)
    gauss = torch.randn(4000, d, generator=g)
    outliers = torch.randn(4000, d, generator=g) * torch.where(torch.arange(d) < 4, 30.0, 1.0)  # 4 hot channels
    want = tq.expected_mse(bits, d)
    for x in (gauss, outliers):
        codes, norms = tq.quantize(x, rot, c)
        rel = ((x - tq.dequantize(codes, norms, rot, c)).norm(dim=1) / x.norm(dim=1)) ** 2
        assert float(rel.mean()) == pytest.approx(want, rel=0.08), bits
    # without the rotation the outlier channels break the one-codebook-per-coordinate premise
    eye = torch.eye(d)
    codes, norms = tq.quantize(outliers, eye, c)
    rel = ((outliers - tq.dequantize(codes, norms, eye, c)).norm(dim=1) / outliers.norm(dim=1)) ** 2
    assert float(rel.mean()) > 2 * want


def test_rotation_is_seeded_and_orthogonal():
    r = tq.rotation(64, seed=3)
    assert torch.allclose(r @ r.t(), torch.eye(64), atol=1e-5)
    assert torch.equal(r, tq.rotation(64, seed=3)) and not torch.equal(r, tq.rotation(64, seed=4))


@pytest.mark.parametrize("bits,d", [(1, 64), (2, 64), (3, 64), (4, 128), (3, 128)])
def test_codes_pack_to_b_bits_per_channel(bits, d):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, 3, d), generator=g, dtype=torch.uint8)
    packed = tq.pack_bits(codes, bits)
    assert packed.shape == (5, 3, d * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(tq.unpack_bits(packed, bits, d), codes)
    one = torch.zeros(1, 8, dtype=torch.uint8)
    one[0, 1] = 1  # channel 1's code starts at bit `bits`
    assert int(tq.pack_bits(one, bits)[0, 0]) == 1 << bits if bits < 8 else True


def test_zero_vectors_and_fp16_norms():
    rot, c = tq.rotation(64, seed=1), tq.codebook(2, 64)
    x = torch.zeros(2, 64)
    x[1] = torch.linspace(-1, 1, 64)
    codes, norms = tq.quantize(x, rot, c, norm_dtype=torch.float16)
    assert norms.dtype == torch.float16
    out = tq.dequantize(codes, norms, rot, c)
    assert torch.equal(out[0], torch.zeros(64))
    assert torch.allclose(out[1].norm(), x[1].norm() * c[codes[1].long()].norm(), rtol=1e-3)
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.codebook(5, 64)


def test_attention_over_codes_equals_attention_over_dequantized_kv():
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 8, 2, 64, 37
    rot, ck, cv = tq.rotation(d, seed=2), tq.codebook(3, d), tq.codebook(2, d)
    q, k, v = torch.randn(hq, d, generator=g), torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    kc, kn = tq.quantize(k, rot, ck, norm_dtype=torch.float16)
    vc, vn = tq.quantize(v, rot, cv, norm_dtype=torch.float16)
    got = tq.turboquant_attention(q, kc, kn, vc, vn, rot, ck, cv)
    kh, vh = tq.dequantize(kc, kn, rot, ck), tq.dequantize(vc, vn, rot, cv)
    group = hq // hkv
    want = torch.stack([torch.softmax(kh[:, h // group] @ q[h] / math.sqrt(d), 0) @ vh[:, h // group]
                        for h in range(hq)])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    exact = torch.stack([torch.softmax(k[:, h // group] @ q[h] / math.sqrt(d), 0) @ v[:, h // group]
                         for h in range(hq)])
    assert (got - exact).norm() < 0.5 * exact.norm()  # and it is an approximation of the real thing


def test_blocks_round_trip_and_decode_over_blocks_plus_residual():
    """The store's layout (blocks of G tokens, packed codes, fp16 norms) and decode over a block
    table + full-precision residual rows equal plain attention over the dequantized history and
    the residual, per request (two requests, one with no history, one with nothing)."""
    g = torch.Generator().manual_seed(9)
    hq, hkv, d, group, bits = 4, 2, 64, 8, 3
    rot, c = tq.rotation(d, seed=5), tq.codebook(bits, d)
    hist = torch.randn(3 * group, hkv, d, generator=g)
    codes, norms = tq.quantize_blocks(hist, rot, c, bits, group)
    assert codes.shape == (3, hkv, group, d * bits // 8) and norms.dtype == torch.float16
    deq = tq.dequantize_blocks(codes, norms, rot, c, bits)
    want_codes, want_norms = tq.quantize(hist, rot, c, torch.float16)
    torch.testing.assert_close(deq, tq.dequantize(want_codes, want_norms, rot, c))
    # a pool of 3 blocks stored out of order, residual rows in a slot pool
    store_codes, store_norms = torch.zeros(5, *codes.shape[1:], dtype=torch.uint8), torch.zeros(5, hkv, group,
                                                                                             dtype=torch.float16)
    order = [4, 0, 2]
    store_codes[order], store_norms[order] = codes, norms
    k_cache, v_cache = torch.randn(20, hkv, d, generator=g), torch.randn(20, hkv, d, generator=g)
    block_table = torch.tensor([[0, 0, 0], [4, 0, 2], [0, 0, 0]])
    req_to_token = torch.tensor([[3, 7, 1, 0], [5, 6, 0, 0], [0, 0, 0, 0]])
    q = torch.randn(3, hq, d, generator=g)
    req_rows, n_blocks, res_len = torch.tensor([1, 0, 2]), torch.tensor([3, 0, 0]), torch.tensor([2, 3, 0])
    got = tq.turboquant_decode_attention(q, store_codes, store_norms, store_codes, store_norms, rot, c, c,
                                         block_table, req_rows, n_blocks, k_cache, v_cache, req_to_token, res_len,
                                         bits)
    for b, kv in enumerate([
            (torch.cat([deq, k_cache[[5, 6]]]), torch.cat([deq, v_cache[[5, 6]]])),  # row 1: 3 blocks + 2 rows
            (k_cache[[3, 7, 1]], v_cache[[3, 7, 1]]),  # row 0: residual only
            None]):  # row 2: nothing
        if kv is None:
            assert torch.equal(got[b], torch.zeros(hq, d))
            continue
        keys, vals = kv
        want = torch.stack([torch.softmax(keys[:, h // 2] @ q[b, h] / math.sqrt(d), 0) @ vals[:, h // 2]
                            for h in range(hq)])
        torch.testing.assert_close(got[b], want, atol=3e-5, rtol=1e-4)
