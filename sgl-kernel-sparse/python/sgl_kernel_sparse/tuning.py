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
kernel keeps its built-in heuristics. Read once per process and device (``preload``, called by
the SGLang adapter when it builds its attention backend: never for the first time inside a
forward that torch.compile traces); the wrappers look up on the host while CUDA graphs are
captured, and a replay runs the chosen launch.
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


HBM_TBPS = {"H200": 4.8, "H100": 3.35}  # HBM ceilings (TB/s) by a part of the device name (SXM parts)


def hbm_tbps(device_name: str) -> float | None:
    """The HBM bandwidth ceiling of a GPU by its ``torch.cuda.get_device_name()`` (``None``: not
    known here); the kernel benchmarks state their % of HBM against it."""
    return next((v for k, v in HBM_TBPS.items() if k in device_name), None)


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


_POW2 = ("block_n", "block_p", "chunk", "num_warps")  # tile sizes and warps: powers of two
_INTS = {"num_splits": 1, "num_warps": 1, "num_stages": 0, "block_n": 1, "block_p": 1, "chunk": 1}  # -> minimum
_CHOICES = {"prefetch": (True, False), "method": ("bits", "radix", "nibble")}


def _bad_option(name: str, value) -> bool:
    if value is None:  # null: the wrapper's own heuristic, as an argument left None
        return name not in _INTS and name not in _CHOICES
    if name == "prefetch":
        return not isinstance(value, bool)
    if name in _CHOICES:
        return value not in _CHOICES[name]
    if name not in _INTS:
        return True  # an option no wrapper takes
    if not isinstance(value, int) or isinstance(value, bool) or value < _INTS[name]:
        return True
    return (name in _POW2 and value & (value - 1) != 0) or (name == "num_warps" and value > 32)


def _parse(raw) -> dict:
    """``{kernel: [(batch, options), ...]}`` sorted by batch, from the file's JSON object. An entry
    with an option no wrapper takes or a value it cannot launch (``num_splits`` 0, a tile that is
    not a power of two, ...) is dropped with a warning: that batch keeps the heuristics."""
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    table = {}
    for kernel, entries in raw.items():
        if kernel.startswith("_") or not isinstance(entries, dict):
            continue
        rows = []
        for key, options in entries.items():
            if not (str(key).isdecimal() and str(key).isascii() and isinstance(options, dict)):
                continue
            bad = sorted(k for k, v in options.items() if _bad_option(k, v))
            if bad:
                warnings.warn(f"sgl_kernel_sparse: tuning entry {kernel}[{key}] ignored: bad {', '.join(bad)}")
                continue
            rows.append((int(key), dict(options)))
        table[kernel] = sorted(rows, key=lambda r: r[0])
    return table


def _table(device: torch.device) -> dict:
    """The parsed table of ``device``, read on the first call (``preload``, when the adapter builds
    its attention backend); lookups in a traced or captured forward then only walk a list."""
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


def preload(device: torch.device) -> dict:
    """Read ``device``'s table now (the SGLang adapter calls it when its attention backend is
    built), so that no lookup inside a traced or captured forward touches the file system."""
    return _table(device)


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
