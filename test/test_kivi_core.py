"""KIVI on the toy engine (no SGLang): what the block store holds equals the reference quantizer
exactly (same rounding, fp16 scales), the residual window follows KIVI's rule after the prompt and
while decoding, decode attention over blocks + residual equals attention over the explicitly
dequantized history, and every block and slot comes back."""

from __future__ import annotations

import pytest
import torch
from sgl_kernel_sparse import quant

from sglang_sparse.kernels.quantized import kivi_decode
from toy_engine import HKV, HQ, LAYERS, ToyEngine, qkv

G, R = 8, 16


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_blocks_equal_the_reference_and_decode_reads_them(bits):
    length = 100
    q, k, v = qkv(length, seed=21)
    eng = ToyEngine("kivi", {"bits": bits, "group": G, "residual": R})
    rt = eng.ctl.runtime
    free0, blocks0 = eng.store.free_count(), rt.blocks.free_count()
    eng.prefill("a", 0, q, k, v, chunk=32)
    n_q = (length - R) // G * G  # 80 tokens quantized, 20 stay full precision
    ret = eng.ctl.cache.retained("a")
    assert (ret.n_rows, ret.logical_len, ret.offset) == (length - n_q, length, n_q)
    mine = eng.ctl.cache.requests["a"].metadata["kivi_blocks"]
    assert len(mine) == n_q // G and eng.store.free_count() == free0 - (length - n_q)
    for layer in range(LAYERS):
        kc, ks, km = quant.kivi_quantize_keys(k[layer][:n_q], bits, G, scale_dtype=torch.float16)
        vc, vs, vm = quant.kivi_quantize_values(v[layer][:n_q], bits, G, scale_dtype=torch.float16)
        got = [t[mine] for t in rt.blocks.layer(layer)]
        for a, b in zip(got, (kc, ks, km, vc, vs, vm)):
            assert torch.equal(a, b)  # exactly the reference quantizer
        torch.testing.assert_close(eng.ctl.cache.keys("a", layer), k[layer][n_q:])  # residual intact

    # decode 12 tokens: the residual reaches R + G = 24 rows, its oldest G are quantized
    keys = [k[layer].clone() for layer in range(LAYERS)]
    vals = [v[layer].clone() for layer in range(LAYERS)]
    for step in range(12):
        dq, dk, dv = qkv(1, seed=40 + step)
        eng.views.clear()
        eng.decode("a", 0, dq, dk, dv)
        for layer in range(LAYERS):
            keys[layer] = torch.cat([keys[layer], dk[layer]])
            vals[layer] = torch.cat([vals[layer], dv[layer]])
        ret = eng.ctl.cache.retained("a")
        assert R <= ret.n_rows < R + G
        # attention of this step's query over dequantized blocks + residual, layer 1
        layer, view = eng.views[1]
        nb = view.n_blocks
        res_len = torch.tensor([eng.ctl.cache.requests["a"].retained.n_rows + 0], dtype=torch.int32)
        # the view was built before this step's safe point: if that point quantized a group the
        # rows moved since; those steps are skipped (11 of the 12 are checked)
        if int(nb[0]) != len(eng.ctl.cache.requests["a"].metadata["kivi_blocks"]):
            continue
        got = kivi_decode(dq[layer], rt.blocks, layer, view.block_table, torch.tensor([0]), nb,
                          eng.store.k[layer], eng.store.v[layer], eng.store.table, res_len, 1 / k[0].shape[-1] ** 0.5)
        nq = int(nb[0]) * G
        kc, ks, km = quant.kivi_quantize_keys(keys[layer][:nq], bits, G, scale_dtype=torch.float16)
        vc, vs, vm = quant.kivi_quantize_values(vals[layer][:nq], bits, G, scale_dtype=torch.float16)
        kh = torch.cat([quant.kivi_dequantize_keys(kc, ks, km, bits), keys[layer][nq:]])
        vh = torch.cat([quant.kivi_dequantize_values(vc, vs, vm, bits), vals[layer][nq:]])
        for h in range(HQ):
            w = torch.softmax((kh[:, h // (HQ // HKV)] @ dq[layer][0, h].float()) / k[0].shape[-1] ** 0.5, 0)
            torch.testing.assert_close(got[0, h], w @ vh[:, h // (HQ // HKV)], rtol=1e-4, atol=1e-4)
    assert len(eng.ctl.cache.requests["a"].metadata["kivi_blocks"]) == (length + 12 - R) // G or len(eng.ctl.cache.requests["a"].metadata["kivi_blocks"]) == n_q // G + 1
    eng.finish("a", 0)
    assert eng.store.free_count() == free0 and rt.blocks.free_count() == blocks0


def test_kivi_bytes_per_token_and_validation():
    from sglang_sparse.registry import ConfigError, build_config

    eng = ToyEngine("kivi", {"bits": 2, "group": G})
    d = eng.store.k.shape[-1]  # 8
    per_layer_head = 2 * d * 2 / 8 + 2 * 2 * d / G + 2 * 2 * d / G  # codes + fp16 scale/min of K and V
    blocks = eng.ctl.runtime.blocks
    assert blocks.bytes_per_token() == LAYERS * HKV * per_layer_head
    assert blocks.bytes_per_block() == blocks.block_bytes(LAYERS, HKV, d, 2, G)
    with pytest.raises(ConfigError, match="fp_fraction=1.0 is out of range"):
        build_config("kivi", {"fp_fraction": 1.0})
    with pytest.raises(ConfigError, match="bits=3 is not supported: must be 2 or 4"):
        build_config("kivi", {"bits": 3})
    with pytest.raises(ConfigError, match="group=24 must be a power of two"):
        build_config("kivi", {"group": 24})
