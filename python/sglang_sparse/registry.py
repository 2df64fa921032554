"""Registry of sparse methods: name -> (config class, runtime class). Engine-agnostic.

Methods register themselves with ``@register_method`` in their own file under ``methods/``;
nothing outside a method's file names it. The registry imports no method: importing the
``sglang_sparse`` package imports ``sglang_sparse.methods``, which imports every method file, so
the table is full wherever the package is used. CLI choices come from ``method_names()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A bad method name or knob; the message says which value and what is allowed."""


@dataclass(frozen=True)
class MethodSpec:
    name: str
    family: str
    config_cls: type
    runtime_cls: type
    summary: str


_METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, family: str, config_cls: type, summary: str):
    def wrap(runtime_cls: type) -> type:
        if name in _METHODS:
            raise ValueError(f"sparse method {name!r} registered twice")
        runtime_cls.name = name
        _METHODS[name] = MethodSpec(name, family, config_cls, runtime_cls, summary)
        return runtime_cls

    return wrap


def method_names() -> list[str]:
    return sorted(_METHODS)


def get_method(name: str) -> MethodSpec:
    try:
        return _METHODS[name]
    except KeyError:
        raise ConfigError(
            f"unknown sparse method {name!r}; available: {', '.join(sorted(_METHODS))}"
        ) from None


@dataclass(frozen=True)
class PrefillSpec:
    """A sparse prefill policy (``--sparse-prefill NAME``): composes with any decode method."""

    name: str
    config_cls: type
    policy_cls: type
    summary: str


_PREFILL: dict[str, PrefillSpec] = {}


def register_prefill(name: str, config_cls: type, summary: str):
    def wrap(policy_cls: type) -> type:
        if name in _PREFILL:
            raise ValueError(f"sparse prefill {name!r} registered twice")
        policy_cls.name = name
        _PREFILL[name] = PrefillSpec(name, config_cls, policy_cls, summary)
        return policy_cls

    return wrap


def prefill_names() -> list[str]:
    return sorted(_PREFILL)


def catalog() -> dict[str, list[dict[str, str]]]:
    """Every registered method and prefill policy, as ``GET /sparse/info`` lists them (``available``):
    what ``--sparse-method`` and ``--sparse-prefill`` accept, with family and one-line summary."""
    return {"methods": [{"name": m.name, "family": m.family, "summary": m.summary}
                        for m in sorted(_METHODS.values(), key=lambda m: m.name)],
            "prefill": [{"name": p.name, "summary": p.summary} for p in sorted(_PREFILL.values(), key=lambda p: p.name)]}


def get_prefill(name: str) -> PrefillSpec:
    try:
        return _PREFILL[name]
    except KeyError:
        raise ConfigError(f"unknown --sparse-prefill {name!r}; available: none, {', '.join(sorted(_PREFILL))}") from None


def build_prefill_config(name: str, knobs: dict[str, Any] | None = None):
    """The prefill policy's validated config (its options are ``--sparse-prefill-<option>``)."""
    return _validated(get_prefill(name).config_cls, knobs, f"--sparse-prefill {name}")


def build_config(name: str, knobs: dict[str, Any] | None = None):
    """The method's validated config from ``knobs`` (unknown knobs are refused)."""
    return _validated(get_method(name).config_cls, knobs, f"sparse method {name!r}")


def _validated(config_cls: type, knobs: dict[str, Any] | None, who: str):
    """``config_cls(**knobs)``, validated; unknown knobs refused with a sentence naming ``who``."""
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(knobs or {}) - fields)
    if unknown:
        raise ConfigError(f"{who} has no option {', '.join(unknown)}; "
                          f"its options: {', '.join(sorted(fields)) or '(none)'}")
    config = config_cls(**(knobs or {}))
    config.validate()
    return config


def check_evict_prefill(value: str) -> None:
    """The ``evict_prefill`` switch of the online eviction methods (H2O, SkipKV)."""
    if value not in ("on", "off"):
        raise ConfigError(f"evict_prefill={value!r} is not allowed: must be on (evict back to the budget between "
                          "prompt chunks) or off (hold the whole prompt until its last chunk)")


def check_range(name: str, value: int, low: int, high: int | None = None) -> None:
    """Raise ConfigError naming the option, the bad value and the allowed range."""
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{name}={value} is out of range: must be {allowed}")
