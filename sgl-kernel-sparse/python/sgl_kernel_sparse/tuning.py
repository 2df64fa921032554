"""Launch configurations chosen by a sweep on one GPU model, looked up by the kernel wrappers.

Like SGLang's per-device fused-MoE config files: ``configs/<device name>.json`` next to this file
(spaces in ``torch.cuda.get_device_name()`` become ``_``, e.g. ``NVIDIA_H200.json``), or the file
named by ``SGL_KERNEL_SPARSE_TUNING`` (applies to every device, CPU interpreter runs included;
``none`` turns every table off).
Written by ``benchmark/gpu/tune_quest_kernels.py --write-config``. Format::

    {"_meta": {...how it was measured...},
     "paged_sparse_decode_attention": {"1": {"num_splits": 16, "block_n": 32}, "4": {...}},
     ...}

``lookup(kernel, batch, device)`` returns the entry of the largest batch key ``<= batch`` (``{}``
when there is none, no file, or the file does not parse), and a wrapper uses a value only for an
argument its caller left ``None``: an explicit argument always wins, and without a file every
kernel keeps its built-in heuristics. Read once per process and device (never inside a captured
graph: the wrappers look up while CUDA graphs are being captured, on the host).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

ENV = "SGL_KERNEL_SPARSE_TUNING"
_OFF = ("none", "off", "0")  # values of ENV that turn every table off (built-in heuristics only)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"
_TABLES: dict = {}  # device key -> parsed table


def config_name(device_name: str) -> str:
    """File name of a device's packaged table: ``NVIDIA H200`` -> ``NVIDIA_H200.json``."""
    return device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def _path_for(device: torch.device) -> Path | None:
    env = os.environ.get(ENV)
    if env in _OFF:
        return None
    if env:
        return Path(env)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return CONFIG_DIR / config_name(torch.cuda.get_device_name(index))


def _parse(raw) -> dict:
    """``{kernel: [(batch, options), ...]}`` sorted by batch, from the file's JSON object."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    table = {}
    for kernel, entries in raw.items():
        if kernel.startswith("_") or not isinstance(entries, dict):
            continue
        table[kernel] = sorted((int(k), dict(v)) for k, v in entries.items()
                               if str(k).isdigit() and isinstance(v, dict))
    return table


def _table(device: torch.device) -> dict:
    """The parsed table of ``device``, read on the first call (SGLang's eager warm-up forwards
    come before CUDA-graph capture and torch.compile tracing, which then only walk a list)."""
    key = (device.type, device.index)
    if key not in _TABLES:
        path = _path_for(device)
        table: dict = {}
        if path is not None and path.is_file():
            try:
                table = _parse(json.loads(path.read_text()))
            except (OSError, ValueError, TypeError) as exc:  # a broken file must not break serving
                warnings.warn(f"sgl_kernel_sparse: ignoring kernel tuning file {path}: {exc}")
                table = {}
        _TABLES[key] = table
    return _TABLES[key]


def lookup(kernel: str, batch: int, device: torch.device) -> dict:
    """The tuned keyword arguments of ``kernel`` at ``batch`` on ``device`` (``{}``: none)."""
    found: dict = {}
    for key, options in _table(device).get(kernel, ()):
        if key <= batch:
            found = options
    return dict(found)


def fill(kernel: str, batch: int, device: torch.device, **given) -> dict:
    """``given`` with every ``None`` value replaced by the tuned one, where the table has one."""
    tuned = lookup(kernel, batch, device)
    return {k: (tuned.get(k) if v is None else v) for k, v in given.items()}


def clear_cache() -> None:
    """Forget parsed tables (tests that point ``SGL_KERNEL_SPARSE_TUNING`` at a new file)."""
    _TABLES.clear()
