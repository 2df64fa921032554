"""TurboQuant as a method on the toy engine (no SGLang): the blocks hold exactly the reference
quantizer's codes and fp16 norms (``sgl_kernel_sparse.turboquant``), the residual window follows
KIVI's rule, decode over blocks + residual equals attention over the dequantized history, bytes
per token follow the layout, flags are validated, and every block and slot comes back."""

from __future__ import annotations

import pytest
import torch
from sgl_kernel_sparse import turboquant as tq

from sglang_sparse.kernels.quantized import quantized_decode
from sglang_sparse.registry import ConfigError, build_config
from toy_engine import HKV, HQ, LAYERS, ToyEngine, qkv

G, R = 8, 16


@pytest.mark.parametrize("bits", [2, 4])
def test_blocks_hold_the_reference_codes_and_decode_reads_them(bits):
    length = 100
    q, k, v = qkv(length, seed=31)
    eng = ToyEngine("turboquant", {"bits": bits, "group": G, "residual": R, "seed": 3})
    rt = eng.ctl.runtime
    free0, blocks0 = eng.store.free_count(), rt.blocks.free_count()
    eng.prefill("a", 0, q, k, v, chunk=32)
    n_q = (length - R) // G * G
    ret = eng.ctl.cache.retained("a")
    assert (ret.n_rows, ret.logical_len, ret.offset) == (length - n_q, length, n_q)
    mine = eng.ctl.cache.requests["a"].metadata["turboquant_blocks"]
    assert len(mine) == n_q // G and rt.counters["turboquant_blocks_written"] == n_q // G
    d = k[0].shape[-1]
    rot, c = tq.rotation(d, seed=3), tq.codebook(bits, d)
    for layer in range(LAYERS):
        kc, kn = tq.quantize_blocks(k[layer][:n_q], rot, c, bits, G)
        vc, vn = tq.quantize_blocks(v[layer][:n_q], rot, c, bits, G)
        for got, want in zip([t[mine] for t in rt.blocks.layer(layer)], (kc, kn, vc, vn)):
            assert torch.equal(got, want)  # exactly the reference quantizer
        torch.testing.assert_close(eng.ctl.cache.keys("a", layer), k[layer][n_q:])
    dq, dk, dv = qkv(1, seed=50)
    eng.views.clear()
    eng.decode("a", 0, dq, dk, dv)
    layer, view = eng.views[1]
    res_len = torch.tensor([eng.ctl.cache.retained("a").n_rows], dtype=torch.int32)
    assert int(view.n_blocks[0]) == len(mine)
    got = quantized_decode(dq[layer], rt.blocks, layer, view.block_table, torch.tensor([0]), view.n_blocks,
                           eng.store.k[layer], eng.store.v[layer], eng.store.table, res_len, d ** -0.5)
    kh = torch.cat([rt.blocks.read(layer, mine)[0], k[layer][n_q:], dk[layer]])
    vh = torch.cat([rt.blocks.read(layer, mine)[1], v[layer][n_q:], dv[layer]])
    for h in range(HQ):
        w = torch.softmax((kh[:, h // (HQ // HKV)] @ dq[layer][0, h].float()) * d ** -0.5, 0)
        torch.testing.assert_close(got[0, h], w @ vh[:, h // (HQ // HKV)], rtol=1e-4, atol=1e-4)
    eng.finish("a", 0)
    assert eng.store.free_count() == free0 and rt.blocks.free_count() == blocks0


def test_bytes_per_token_and_validation():
    eng = ToyEngine("turboquant", {"bits": 3, "group": G})
    d = eng.store.k.shape[-1]  # 8
    blocks = eng.ctl.runtime.blocks
    assert blocks.bytes_per_token() == LAYERS * HKV * 2 * (d * 3 / 8 + 2)  # codes + an fp16 norm, K and V
    assert blocks.bytes_per_block() == blocks.block_bytes(LAYERS, HKV, d, 3, G)
    with pytest.raises(ConfigError, match="bits=5 is not supported: must be 2, 3 or 4"):
        build_config("turboquant", {"bits": 5})
    with pytest.raises(ConfigError, match="fp_fraction=0.0 is out of range"):
        build_config("turboquant", {"fp_fraction": 0.0})
    with pytest.raises(ConfigError, match="seed=-1 is out of range"):
        build_config("turboquant", {"seed": -1})
