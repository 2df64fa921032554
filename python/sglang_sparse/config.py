"""Server flags of sglang_sparse, derived from the method registry (engine-agnostic).

``--sparse-method NAME`` picks a registered method; every option of every method's config
dataclass becomes ``--sparse-<option>`` (underscores as dashes). An option the chosen method
does not have is refused, and each method validates its own values (``registry.ConfigError``).
"""

from __future__ import annotations

import argparse
import dataclasses

from sglang_sparse.registry import (ConfigError, build_config, build_prefill_config, get_method, get_prefill,
                                    method_names, prefill_names)

DEFAULT_METHOD = "dense"


def _options(config_classes) -> dict[str, type]:
    """Option name -> type over the given config dataclasses (each becomes a flag)."""
    opts: dict[str, type] = {}
    for cls in config_classes:
        for f in dataclasses.fields(cls):
            opts[f.name] = type(f.default) if f.default is not dataclasses.MISSING else str
    return opts


def add_sparse_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sglang_sparse")
    group.add_argument("--sparse-method", default=DEFAULT_METHOD,
                       help=f"sparse method: {', '.join(method_names())} (default {DEFAULT_METHOD})")
    for opt, typ in sorted(_options(get_method(n).config_cls for n in method_names()).items()):
        group.add_argument(f"--sparse-{opt.replace('_', '-')}", dest=f"sparse_opt_{opt}", type=typ,
                           default=None, help=f"method option {opt}")
    group.add_argument("--sparse-prefill", default="none",
                       help=f"sparse prefill: none, {', '.join(prefill_names())} (composes with any --sparse-method)")
    for opt, typ in sorted(_options(get_prefill(n).config_cls for n in prefill_names()).items()):
        group.add_argument(f"--sparse-prefill-{opt.replace('_', '-')}", dest=f"sparse_prefill_opt_{opt}", type=typ,
                           default=None, help=f"sparse prefill option {opt}")


def parse_sparse_args(argv: list[str]) -> tuple[dict, list[str]]:
    """Split argv into the sglang_sparse config ``{"method", "options"}`` and the rest (for SGLang).
    Raises ConfigError with a sentence naming the bad value."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_sparse_args(parser)
    try:
        ns, rest = parser.parse_known_args(argv)
    except SystemExit:
        raise ConfigError("bad sglang_sparse flag value (see the message above)") from None
    given = {k.removeprefix("sparse_opt_"): v for k, v in vars(ns).items()
             if k.startswith("sparse_opt_") and v is not None}
    config = build_config(ns.sparse_method, given)
    out = {"method": ns.sparse_method, "options": dataclasses.asdict(config)}
    prefill = {k.removeprefix("sparse_prefill_opt_"): v for k, v in vars(ns).items()
               if k.startswith("sparse_prefill_opt_") and v is not None}
    if ns.sparse_prefill == "none":
        if prefill:
            flags = ", ".join(f"--sparse-prefill-{k.replace('_', '-')}" for k in sorted(prefill))
            raise ConfigError(f"{flags} given without --sparse-prefill; choose one of: {', '.join(prefill_names())}")
    else:
        cfg = build_prefill_config(ns.sparse_prefill, prefill)
        out["prefill"] = {"name": ns.sparse_prefill, "options": dataclasses.asdict(cfg)}
    return out, rest
