"""A tensor-parallel-ready copy of the default model, for ``--tp-size 2`` on the CPU.

SmolLM2-135M has 9 query heads in 3 KV groups; SGLang splits heads evenly across ranks, so no
``--tp-size`` above 1 divides it. This module writes ``<cache>/SmolLM2-135M-Instruct-kv4``: the
same function with 4 KV groups. The last group is duplicated (its K and V rows and its 3 query
heads' Q rows) and the ``o_proj`` columns of both copies are halved: the copy attends exactly as
the original, and ``0.5 o + 0.5 o = o``, so the model computes what the default model computes
(up to float rounding), with 12 query heads over 4 KV heads of 64 dims. ``--tp-size 2`` and
``--tp-size 4`` divide it. Embeddings, norms and MLPs are unchanged.

Engine-agnostic (torch, safetensors). ``python -m sglang_sparse.tp_model`` prints the path.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

from sglang_sparse.default_model import MANIFEST, cache_root, ensure_default_model, sha256_file

NAME = "SmolLM2-135M-Instruct-kv4"
DUPLICATED = 1  # KV groups duplicated (the last ones): 3 + 1 = 4 KV heads
FORMAT_VERSION = 1


def _widen(src: Path, out: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    config = json.loads((src / "config.json").read_text())
    d = config["head_dim"]
    per_group = config["num_attention_heads"] // config["num_key_value_heads"]
    groups = config["num_key_value_heads"]
    # the duplicated groups' rows: Q rows [q0, q_end), K / V rows [kv0, kv_end), o_proj columns [q0, q_end)
    q0, q_end = (groups - DUPLICATED) * per_group * d, groups * per_group * d
    kv0, kv_end = (groups - DUPLICATED) * d, groups * d
    weights = load_file(str(src / "model.safetensors"))
    wide = {}
    for name, w in weights.items():
        if name.endswith("self_attn.q_proj.weight"):
            w = torch.cat([w, w[q0:q_end]])
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            w = torch.cat([w, w[kv0:kv_end]])
        elif name.endswith("self_attn.o_proj.weight"):
            half = w[:, q0:q_end] * 0.5
            w = torch.cat([w[:, :q0], half, half], dim=1)
        wide[name] = w.contiguous().to(torch.float32)
    save_file(wide, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.update(num_attention_heads=(groups + DUPLICATED) * per_group, num_key_value_heads=groups + DUPLICATED)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for p in src.iterdir():
        if p.is_file() and p.name not in ("config.json", "model.safetensors", MANIFEST):
            shutil.copy(p, out / p.name)


def ensure_tp_model(log=print) -> Path:
    """Return the directory of the 4-group model, writing it on first use (safe across processes)."""
    src = ensure_default_model(log)
    root, out = cache_root(), cache_root() / NAME
    with open(root / f"{NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = out / MANIFEST
        if manifest.is_file() and json.loads(manifest.read_text()).get("source") == sha256_file(src / MANIFEST) \
                and json.loads(manifest.read_text()).get("format_version") == FORMAT_VERSION:
            return out
        tmp = root / f"{NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _widen(src, tmp)
        (tmp / MANIFEST).write_text(json.dumps({"format_version": FORMAT_VERSION,
                                                "source": sha256_file(src / MANIFEST), "duplicated_groups": DUPLICATED}))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        log(f"sglang_sparse: wrote {out} ({src.name} with 4 KV groups)")
        return out


if __name__ == "__main__":
    print(ensure_tp_model(log=lambda m: print(m, file=sys.stderr)))
