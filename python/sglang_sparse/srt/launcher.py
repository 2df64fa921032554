"""``python -m sglang_sparse.launch_server [SGLang flags]``: SGLang's own server with sglang_sparse.

Every SGLang flag is passed through unchanged; sglang_sparse's own flags (``--sparse-method`` and
``--sparse-<option>``, see ``sglang_sparse.config``) are taken out first and validated before
anything starts. Added defaults, each announced in one log line:
- no ``--model-path``: the embedded default model (SmolLM2-135M-Instruct, see ``default_model``);
- no ``--device`` and no GPU: ``--device cpu``;
- on a CPU without ``--max-total-tokens``: a KV pool sized to the machine (``core.kv_budget``);
- on a CPU: ``--sleep-on-idle`` (an idle scheduler otherwise busy-polls a core);
- on a CPU with several ranks (``--tp-size`` / ``--dp-size``): ``SGLANG_CPU_OMP_THREADS_BIND``
  splitting the cores evenly when there are fewer NUMA nodes than ranks (SGLang 0.5.23 stops
  otherwise), and, for ``--tp-size`` > 1, ``SGLANG_NCCL_SO_PATH`` naming no library (SGLang
  0.5.23 builds an NCCL communicator whenever the installed torch ships NCCL, and that fails on a
  CPU device; without it the TP group runs on gloo).

``--tp-size N`` must divide the model's attention heads, and its KV heads or be a multiple of
them: otherwise the launcher stops with a sentence (SGLang's weight loader fails later, less
clearly). The default model (9 heads, 3 KV heads) takes no N > 1; ``sglang_sparse.tp_model``
writes the same function with 4 KV heads.

Then the method's artifacts (``SparseMethodRuntime.prepare_artifacts``, e.g. Palu's factors,
computed from the model once and cached next to it) are found or built before SGLang starts, so
a model-dependent bad value stops the launcher with a sentence too; their paths travel in the
exported configuration (``config["artifacts"]``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from sglang_sparse.artifacts import TP_FLAGS
from sglang_sparse.config import parse_sparse_args
from sglang_sparse.core import kv_budget
from sglang_sparse.core.logical_tree import UNSUPPORTED_EVICTION_POLICIES
from sglang_sparse.core.runtime import SparseMethodRuntime
from sglang_sparse.default_model import DefaultModelError, ensure_default_model
from sglang_sparse.registry import ConfigError, build_config, get_method
from sglang_sparse.srt import activation

logger = logging.getLogger("sglang_sparse.launch_server")


def _given_flags(argv: list[str]) -> argparse.Namespace:
    """Read the few SGLang flags the launcher defaults, without consuming anything."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model-path", "--model", dest="model_path")
    parser.add_argument("--device")
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--dtype")
    parser.add_argument("--kv-cache-dtype")
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--sleep-on-idle", action="store_true")
    parser.add_argument("--attention-backend")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-backend-prefill")
    parser.add_argument("--page-size", type=int)
    parser.add_argument(*TP_FLAGS, dest="tp_size", type=int, default=1)
    parser.add_argument("--dp-size", "--dp", "--data-parallel-size", dest="dp_size", type=int, default=1)
    parser.add_argument("--pp-size", "--pp", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    known, _ = parser.parse_known_args(argv)
    return known


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _cpu_pool_size(model_path: str, given: argparse.Namespace) -> tuple[int, str]:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return kv_budget.CPU_POOL_CAP_TOKENS, "model config not local; using the CPU cap"
    config = json.loads(config_file.read_text())
    kv_dtype = next((d for d in (given.kv_cache_dtype, given.dtype) if d and d != "auto"), None)
    text_config = config.get("text_config", config)
    if kv_dtype is None and str(text_config.get("torch_dtype") or text_config.get("dtype")) == "float32":
        kv_dtype = "float16"  # SGLang's --dtype auto serves fp32 checkpoints in 16-bit
    per_token = kv_budget.kv_bytes_per_token(config, kv_dtype)
    context = given.context_length or int(text_config.get("max_position_embeddings", 8192))
    avail = _available_memory_bytes()
    tokens = kv_budget.cpu_pool_tokens(per_token, avail, context)
    why = (
        f"{tokens * per_token / 2**30:.1f} GiB of {avail / 2**30:.1f} GiB available, "
        f"{per_token} B/token"
    )
    return tokens, why


def complete_argv(argv: list[str], log=logger.info) -> list[str]:
    """SGLang argv with the launcher's defaults added (see module docstring)."""
    argv = list(argv)
    given = _given_flags(argv)
    if given.model_path is None:
        model_dir = ensure_default_model(log=log)
        log(f"sglang_sparse: no --model-path; serving the default model from {model_dir}")
        argv += ["--model-path", str(model_dir)]
        given.model_path = str(model_dir)
    _check_tp_heads(given)
    device = given.device
    if device is None:
        import torch

        if not torch.cuda.is_available():
            device = "cpu"
            argv += ["--device", "cpu"]
    if device != "cpu":
        return argv
    added = []
    if given.max_total_tokens is None:
        tokens, why = _cpu_pool_size(given.model_path, given)
        argv += ["--max-total-tokens", str(tokens)]
        added.append(f"KV pool {tokens} tokens ({why})")
    if not given.sleep_on_idle:
        # An idle SGLang scheduler busy-polls a whole core; on a small CPU machine that core is
        # the one the tokenizer, detokenizer and clients need.
        argv += ["--sleep-on-idle"]
        added.append("--sleep-on-idle")
    added += _cpu_ranks(given)
    log("sglang_sparse: CPU serving (--device cpu)" + (f"; added {', '.join(added)}" if added else ""))
    return argv


def _check_tp_heads(given: argparse.Namespace) -> None:
    tp = given.tp_size
    config_file = Path(given.model_path) / "config.json"
    if tp <= 1 or not config_file.is_file():
        return
    config = json.loads(config_file.read_text())
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    kv = config.get("num_key_value_heads", heads)
    if heads is None:
        return
    if heads % tp or (kv % tp and tp % kv):
        raise ConfigError(f"--tp-size {tp} does not split this model's {heads} attention heads and {kv} KV heads: "
                          f"the size must divide the attention heads, and divide the KV heads or be a multiple "
                          f"of them (the default model takes none above 1; `python -m sglang_sparse.tp_model` "
                          f"writes it with 4 KV heads)")


def _numa_nodes() -> int:
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    return max(1, len(nodes))


def _cpu_ranks(given: argparse.Namespace) -> list[str]:
    """Environment SGLang 0.5.23 needs to run several CPU ranks (module docstring)."""
    added = []
    ranks = given.tp_size * given.dp_size * given.pp_size
    if ranks > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ and ranks > _numa_nodes():
        cores = sorted(os.sched_getaffinity(0))
        per = max(1, len(cores) // ranks)
        groups = [cores[(i * per) % len(cores): (i * per) % len(cores) + per] for i in range(ranks)]
        bind = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = bind
        added.append(f"SGLANG_CPU_OMP_THREADS_BIND={bind}")
    if given.tp_size > 1 and "SGLANG_NCCL_SO_PATH" not in os.environ:
        os.environ["SGLANG_NCCL_SO_PATH"] = NO_NCCL
        added.append(f"SGLANG_NCCL_SO_PATH={NO_NCCL} (the TP group runs on gloo)")
    return added


SPARSE_BACKENDS = ("torch_native", "triton")
NO_NCCL = "sglang-sparse-cpu-has-no-nccl"  # a library name that does not load


def _serves_on_gpu(given: argparse.Namespace) -> bool:
    if given.device is not None:
        return given.device == "cuda"
    import torch

    return torch.cuda.is_available()


def sparse_config(argv: list[str], log=logger.info) -> tuple[dict, list[str]]:
    """Take the sglang_sparse flags out of argv and check the method can run with the rest.
    Raises ConfigError with a sentence saying what is wrong."""
    config, argv = parse_sparse_args(argv)
    runtime = get_method(config["method"]).runtime_cls
    config["chain_cache"], argv = _chain_cache(config["method"], runtime, argv, log)
    config["chain_replica"], argv = _chain_replica(argv, config["chain_cache"])
    radix_asked = "--disable-radix-cache" not in argv  # before an evicting method turns SGLang's off
    overlap, argv = _overlap(config["method"], runtime, argv)
    if runtime.evicts_kv:
        # Compaction happens between steps and rows stop matching logical tokens (see
        # engine/steps.py): no mixed chunks, no radix insertion, and SGLang's overlap scheduler
        # only when asked for (--sparse-overlap on).
        if "--enable-mixed-chunk" in argv:
            raise ConfigError(f"--sparse-method {config['method']} evicts KV and cannot run with --enable-mixed-chunk")
        if "--enable-streaming-session" in argv:
            # A streaming session would lend retained rows as if they were logical tokens.
            raise ConfigError(f"--sparse-method {config['method']} evicts KV and cannot run with "
                              "--enable-streaming-session; plain sessions resume through Chain Cache")
        for flag in ["--disable-radix-cache"] + ([] if overlap else ["--disable-overlap-schedule"]):
            if flag not in argv:
                argv.append(flag)
                log(f"sglang_sparse: {config['method']} evicts KV physically; added {flag}")
        if overlap:
            log(f"sglang_sparse: --sparse-overlap on: {config['method']} evicts under SGLang's overlap scheduler "
                "(experimental: a compaction first waits for the step in flight)")
    given = _given_flags(argv)
    prefill = config.get("prefill")
    if runtime.changes_attention or prefill:
        on_gpu = _serves_on_gpu(given)
        backend = given.attention_backend
        if backend not in (None, *SPARSE_BACKENDS):
            who = f"--sparse-prefill {prefill['name']}" if prefill and not runtime.changes_attention else \
                f"--sparse-method {config['method']}"
            raise ConfigError(
                f"{who} needs --attention-backend "
                f"{' or '.join(SPARSE_BACKENDS)} (got {backend}); sparse kernels for other backends are not available yet"
            )
        if backend is None:
            backend = "triton" if on_gpu else "torch_native"
            argv += ["--attention-backend", backend]
            log(f"sglang_sparse: {config['method']} runs on the {backend} attention backend; added --attention-backend {backend}")
    argv = _page_size(config, runtime, argv, given, log)
    argv = _kv_cache_dtype(config, runtime, argv, given, log)
    argv = _radix_backend(config, argv, log)
    # a method store's payload (KIVI's blocks) is cached by our tree in its own units, with
    # SGLang's slot insertion off (cache/radix.py); --disable-radix-cache turns it off too
    config["unit_cache"] = bool(runtime.overrides("cached_units") and radix_asked and _our_tree(argv))
    if config["unit_cache"]:
        log(f"sglang_sparse: the radix cache keeps {config['method']}'s stored payload for prefix reuse "
            "(pass --disable-radix-cache to turn it off)")
    if _serves_on_gpu(given) and not given.disable_cuda_graph:
        if runtime.decode_needs_python():
            # Per-layer Python hooks between kernels (or a decode kernel that is a Python
            # reference): a captured graph would replay the first step's selection forever.
            argv.append("--disable-cuda-graph")
            log(f"sglang_sparse: {config['method']} runs Python in decode; added --disable-cuda-graph")
        elif (runtime.has_layer_hooks() or prefill) and given.cuda_graph_backend_prefill is None:
            # Decode graphs stay (decode runs no Python per layer); prefill hooks do.
            argv += ["--cuda-graph-backend-prefill", "disabled"]
            log(f"sglang_sparse: {config['method']} hooks prefill layers in Python; added --cuda-graph-backend-prefill disabled")
    log(f"sglang_sparse: method {config['method']} {config['options']}"
        + (f"; sparse prefill {prefill['name']} {prefill['options']}" if prefill else ""))
    return config, argv


CHAIN_CACHE_CHOICES = ("auto", "on", "off")
OVERLAP_CHOICES = ("off", "on")


def _take_choice(argv: list[str], flag: str, choices: tuple[str, ...]) -> tuple[str, list[str]]:
    """``flag``'s value (the first of ``choices`` when absent) and argv without it; a value not
    among ``choices`` is refused with a sentence."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(flag, default=choices[0])
    known, rest = parser.parse_known_args(argv)
    choice = getattr(known, flag.lstrip("-").replace("-", "_"))
    if choice not in choices:
        raise ConfigError(f"{flag} {choice} is not one of {', '.join(choices)}")
    return choice, rest


def _overlap(method: str, runtime, argv: list[str]) -> tuple[bool, list[str]]:
    """``--sparse-overlap {off,on}`` (taken out of argv): whether a method that evicts KV keeps
    SGLang's overlap scheduler (off: the launcher adds --disable-overlap-schedule, as before).
    Under it the scheduler prepares step k+1 while step k runs: compaction then happens with a
    step in flight and before that step's results are processed (engine/steps.py). Methods that
    keep their KV run with SGLang's default either way."""
    choice, rest = _take_choice(argv, "--sparse-overlap", OVERLAP_CHOICES)
    if choice == "on" and not runtime.evicts_kv:
        raise ConfigError(f"--sparse-overlap on is for methods that evict KV; --sparse-method {method} keeps its KV "
                          "and runs under SGLang's overlap scheduler unless --disable-overlap-schedule is given")
    if choice == "on" and not runtime.overlap_tested:
        raise ConfigError(f"--sparse-overlap on is not available for --sparse-method {method} yet (tested under "
                          "SGLang's overlap scheduler: h2o, rkv); drop it to run without the overlap scheduler")
    if choice == "on" and "--disable-overlap-schedule" in rest:
        raise ConfigError("--sparse-overlap on asks for SGLang's overlap scheduler, which --disable-overlap-schedule "
                          "turns off: drop one of them")
    return choice == "on", rest


def _chain_cache(method: str, runtime, argv: list[str], log) -> tuple[bool, list[str]]:
    """``--chain-cache {auto,on,off}`` (taken out of argv): auto = on for methods that evict
    (full-KV methods reuse prefixes through SGLang's radix cache)."""
    choice, rest = _take_choice(argv, "--chain-cache", CHAIN_CACHE_CHOICES)
    if choice == "on" and not runtime.supports_chains:
        raise ConfigError(f"--chain-cache on is not supported by --sparse-method {method} yet (Chain Cache cannot "
                          "carry its KV payload); pass --chain-cache off or auto")
    on = choice == "on" or (choice == "auto" and runtime.evicts_kv and runtime.supports_chains)
    if on:
        how = ("parks retained rows" if runtime.evicts_kv else
               "pins each chain's prefix in the radix cache")
        log(f"sglang_sparse: chain cache on for {method}: {how} (pass chain_id to continue a chain)")
    return on, rest


def _chain_replica(argv: list[str], chain_cache: bool) -> tuple[str | None, list[str]]:
    """``--chain-replica NAME`` (taken out of argv): this server's name in its chain ids
    (``chain-NAME-<n>``), for several servers behind one router (docs/scale_out.md)."""
    from sglang_sparse.core.chain_index import REPLICA_NAME_RULE, valid_replica_name

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--chain-replica", default=None)
    known, rest = parser.parse_known_args(argv)
    name = known.chain_replica
    if name is None:
        return None, rest
    if not valid_replica_name(name):
        raise ConfigError(f"--chain-replica {name!r} is not a replica name: use {REPLICA_NAME_RULE}")
    if not chain_cache:
        raise ConfigError("--chain-replica names this server's chains, but Chain Cache is off; "
                          "drop --chain-replica or pass --chain-cache on")
    return name, rest


RADIX_BACKEND = "sglang_sparse"
# SGLang features that build their own prefix cache (our backend replaces SGLang's tree).
_OWN_TREE_FLAGS = ("--enable-hierarchical-cache", "--enable-streaming-session", "--enable-lmcache",
                   "--enable-flexkv", "--enable-unified-cache-external-linker")


def _radix_backend(config: dict, argv: list[str], log) -> list[str]:
    """Select the logical-prefix radix cache (``cache/radix.py``) unless the user chose another
    prefix cache; Chain Cache and /prune need it. It evicts by SGLang's
    ``--radix-eviction-policy`` (its own strategies), except the ones it cannot serve."""
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("--radix-cache-backend")
    given.add_argument("--radix-eviction-policy")
    known = given.parse_known_args(argv)[0]
    backend, policy = known.radix_cache_backend, (known.radix_eviction_policy or "lru").lower()
    own = [f for f in _OWN_TREE_FLAGS if f in argv]
    if backend not in (None, RADIX_BACKEND) or own:
        if config["chain_cache"]:
            what = f"--radix-cache-backend {backend}" if backend not in (None, RADIX_BACKEND) else own[0]
            raise ConfigError(f"--chain-cache needs sglang_sparse's radix cache, which {what} replaces; "
                              "drop it or pass --chain-cache off")
        config["radix_tree"] = False
        return argv
    config["radix_tree"] = "--disable-radix-cache" not in argv
    if policy in UNSUPPORTED_EVICTION_POLICIES:
        raise ConfigError(f"--radix-eviction-policy {policy} is not supported by sglang_sparse's radix cache: "
                          f"{UNSUPPORTED_EVICTION_POLICIES[policy]}; use lru, lfu, slru or priority")
    if backend is None:
        argv = argv + ["--radix-cache-backend", RADIX_BACKEND]
        log(f"sglang_sparse: prefix cache keyed by logical tokens over retained KV; added "
            f"--radix-cache-backend {RADIX_BACKEND}")
    return argv


def _our_tree(argv: list[str]) -> bool:
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("--radix-cache-backend")
    backend = given.parse_known_args(argv)[0].radix_cache_backend
    return backend == RADIX_BACKEND and not any(f in argv for f in _OWN_TREE_FLAGS)


def _kv_cache_dtype(config: dict, runtime, argv: list[str], given, log) -> list[str]:
    """The KV storage dtype the method's payload needs (``--kv-cache-dtype``): set it when not
    given, refuse a conflicting one."""
    need = runtime.required_kv_cache_dtype(build_config(config["method"], config["options"]))
    if need is None:
        # fp8_*, mxfp8, nvfp4, ...: SGLang stores them as uint8 bytes (engine/flat_pool.py keeps that store)
        quantized = given.kv_cache_dtype not in (None, "auto", "bf16", "bfloat16")
        if quantized and runtime.per_layer_rows:
            raise ConfigError(f"--sparse-method {config['method']} packs each layer's kept rows into one flat "
                              f"KV allocation read in the model dtype: --kv-cache-dtype {given.kv_cache_dtype} "
                              f"is not supported with it; drop the flag (auto, bf16 and bfloat16 are allowed)")
        return argv
    if given.kv_cache_dtype is None:
        log(f"sglang_sparse: {config['method']} stores KV as {need}; added --kv-cache-dtype {need}")
        return argv + ["--kv-cache-dtype", need]
    if given.kv_cache_dtype != need:
        raise ConfigError(f"--sparse-method {config['method']} stores KV as {need} and cannot run with "
                          f"--kv-cache-dtype {given.kv_cache_dtype}; drop the flag or pass {need}")
    return argv


def _page_size(config: dict, runtime, argv: list[str], given, log) -> list[str]:
    """The engine's KV page size (``--page-size``) the method needs: set it when not given,
    refuse a conflicting one."""
    need = runtime.required_page_size(build_config(config["method"], config["options"]))
    method = config["method"]
    if need is not None and given.page_size is None:
        log(f"sglang_sparse: {method} keeps metadata per KV page; added --page-size {need}")
        return argv + ["--page-size", str(need)]
    if need is not None and given.page_size != need:
        raise ConfigError(f"--sparse-method {method} needs --page-size {need} (its page size; got "
                          f"--page-size {given.page_size}): set both to the same value")
    if runtime.evicts_kv and (given.page_size or 1) != 1:
        raise ConfigError(f"--sparse-method {method} releases single KV slots and needs --page-size 1 "
                          f"(got {given.page_size})")
    return argv


def method_artifacts(config: dict, argv: list[str], log=logger.info) -> dict:
    """What the method builds from the model before SGLang starts (``prepare_artifacts``: Palu's
    factors), with the model-dependent checks; argv is complete (the model path is known).
    Raises ConfigError with a sentence."""
    runtime = get_method(config["method"]).runtime_cls
    if runtime.prepare_artifacts.__func__ is SparseMethodRuntime.prepare_artifacts.__func__:
        return {}
    model_path = _given_flags(argv).model_path
    return runtime.prepare_artifacts(build_config(config["method"], config["options"]), model_path, argv, log)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        config, argv = sparse_config(argv)
        argv = complete_argv(argv)
        artifacts = method_artifacts(config, argv)
        if artifacts:
            config["artifacts"] = artifacts
    except (ConfigError, DefaultModelError) as err:
        sys.exit(f"sglang_sparse: error: {err}")
    activation.export_config(config)

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
