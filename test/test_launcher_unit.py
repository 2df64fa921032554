"""Launcher defaults, KV sizing and model-dir verification, without starting a server."""

from __future__ import annotations

import json

import pytest

from sglang_sparse.core import kv_budget
from sglang_sparse import default_model

SMOL = {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "hidden_size": 576, "dtype": "float32", "max_position_embeddings": 8192,
}


def test_kv_bytes_per_token_smollm2():
    assert kv_budget.kv_bytes_per_token(SMOL) == 30 * 3 * 64 * 2 * 4
    assert kv_budget.kv_bytes_per_token(SMOL, "bfloat16") == 30 * 3 * 64 * 2 * 2
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        kv_budget.kv_bytes_per_token(SMOL, "int3")


def test_cpu_pool_tokens_bounds():
    per = 46080
    assert kv_budget.cpu_pool_tokens(per, 100 * 2**30, 8192) == kv_budget.CPU_POOL_CAP_TOKENS
    assert kv_budget.cpu_pool_tokens(per, 4 * 2**30, 8192) == 4 * 2**30 // 4 // per
    assert kv_budget.cpu_pool_tokens(per, 2**20, 8192) == 8192  # never below one context


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SMOL))
    monkeypatch.setattr("sglang_sparse.srt.launcher.ensure_default_model", lambda log: tmp_path)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    return tmp_path


def test_complete_argv_fills_model_device_and_pool(fake_model):
    from sglang_sparse.srt.launcher import complete_argv

    lines = []
    argv = complete_argv(["--port", "1"], log=lines.append)
    assert argv[:2] == ["--port", "1"]
    assert argv[argv.index("--model-path") + 1] == str(fake_model)
    assert argv[argv.index("--device") + 1] == "cpu"
    assert int(argv[argv.index("--max-total-tokens") + 1]) >= 8192
    assert "--sleep-on-idle" in argv
    assert any("CPU serving" in line and "23040 B/token" in line for line in lines)  # fp32 -> fp16


def test_complete_argv_keeps_given_flags(fake_model):
    from sglang_sparse.srt.launcher import complete_argv

    given = ["--model", str(fake_model), "--device=cpu", "--max-total-tokens", "4096", "--sleep-on-idle"]
    assert complete_argv(given, log=lambda m: None) == given


def test_cpu_requested_reads_device_flag():
    from sglang_sparse.srt.platform import cpu_requested

    assert cpu_requested(["x", "--device", "cpu"])
    assert cpu_requested(["x", "--device=cpu"])
    assert not cpu_requested(["x", "--device", "cuda"])


def test_verify_dir_detects_tampering(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"weights")
    manifest = {
        "format_version": default_model.FORMAT_VERSION,
        "gguf_sha256": default_model.GGUF_SHA256,
        "files": {"w.bin": default_model.sha256_file(tmp_path / "w.bin")},
    }
    (tmp_path / default_model.MANIFEST).write_text(json.dumps(manifest))
    assert default_model.verify_dir(tmp_path)
    (tmp_path / "w.bin").write_bytes(b"weightz")
    assert not default_model.verify_dir(tmp_path)
    assert not default_model.verify_dir(tmp_path / "missing")


def test_default_model_dir_is_verified(default_model_dir):
    assert default_model.verify_dir(default_model_dir)
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert (default_model_dir / "chat_template.jinja").is_file()


@pytest.mark.parametrize("device,backend", [("cpu", "torch_native"), ("cuda", "triton")])
@pytest.mark.parametrize("method", ["quest", "snapkv"])
def test_sparse_config_picks_the_backend_and_keeps_decode_graphs(device, backend, method):
    from sglang_sparse.srt.launcher import sparse_config

    config, argv = sparse_config(["--device", device, "--sparse-method", method], log=lambda m: None)
    assert config["method"] == method
    assert argv[argv.index("--attention-backend") + 1] == backend
    # Quest's decode selection is graph-safe and SnapKV's decode has no hooks: decode graphs
    # stay; prefill hooks are Python, so prefill graphs go (on the GPU only).
    assert "--disable-cuda-graph" not in argv
    assert ("--cuda-graph-backend-prefill" in argv) is (device == "cuda")


def test_sparse_config_sets_or_checks_the_engine_page_size():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    _, argv = sparse_config(["--device", "cpu", "--sparse-method", "quest", "--sparse-page-size", "32"],
                            log=lambda m: None)
    assert argv[argv.index("--page-size") + 1] == "32"  # Quest summarises physical pages
    with pytest.raises(ConfigError, match="quest needs --page-size 16 .*got --page-size 8"):
        sparse_config(["--device", "cpu", "--sparse-method", "quest", "--page-size", "8"], log=lambda m: None)
    with pytest.raises(ConfigError, match="cannot run with --enable-streaming-session"):
        sparse_config(["--device", "cpu", "--sparse-method", "snapkv", "--enable-streaming-session"],
                      log=lambda m: None)
    with pytest.raises(ConfigError, match="snapkv releases single KV slots and needs --page-size 1"):
        sparse_config(["--device", "cpu", "--sparse-method", "snapkv", "--page-size", "16"], log=lambda m: None)
    _, argv = sparse_config(["--device", "cpu", "--sparse-method", "dense"], log=lambda m: None)
    assert "--page-size" not in argv


def test_sparse_config_keeps_cuda_graphs_for_dense_and_refuses_other_backends():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    _, argv = sparse_config(["--device", "cuda", "--attention-backend", "triton"], log=lambda m: None)
    assert "--disable-cuda-graph" not in argv  # dense has no per-layer hooks
    with pytest.raises(ConfigError, match="needs --attention-backend torch_native or triton \\(got fa3\\)"):
        sparse_config(["--device", "cuda", "--sparse-method", "snapkv", "--attention-backend", "fa3"],
                      log=lambda m: None)


def test_radix_eviction_policy_is_sglangs_or_refused():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    _, argv = sparse_config(["--device", "cpu", "--radix-eviction-policy", "lfu"], log=lambda m: None)
    assert argv[argv.index("--radix-eviction-policy") + 1] == "lfu"  # passed on to SGLang, honoured by the tree
    with pytest.raises(ConfigError, match="--radix-eviction-policy tlru is not supported by sglang_sparse's radix"):
        sparse_config(["--device", "cpu", "--radix-eviction-policy", "tlru"], log=lambda m: None)
    # another prefix cache: SGLang's own tree serves the policy
    sparse_config(["--device", "cpu", "--radix-eviction-policy", "tlru", "--radix-cache-backend", "default"],
                  log=lambda m: None)


def test_fp8_sets_or_checks_the_kv_cache_dtype():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    _, argv = sparse_config(["--device", "cpu", "--sparse-method", "fp8"], log=lambda m: None)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e4m3"
    _, argv = sparse_config(["--device", "cpu", "--sparse-method", "fp8", "--kv-cache-dtype", "fp8_e4m3"],
                            log=lambda m: None)
    assert argv.count("--kv-cache-dtype") == 1
    with pytest.raises(ConfigError, match="fp8 stores KV as fp8_e4m3 and cannot run with --kv-cache-dtype bf16"):
        sparse_config(["--device", "cpu", "--sparse-method", "fp8", "--kv-cache-dtype", "bf16"], log=lambda m: None)
    _, argv = sparse_config(["--device", "cpu", "--sparse-method", "dense"], log=lambda m: None)
    assert "--kv-cache-dtype" not in argv


@pytest.mark.parametrize("method", ["kvzip", "pyramidkv"])
@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2", "mxfp8"])
def test_per_layer_methods_refuse_a_quantized_kv_cache(method, kv_dtype):
    """KVzip and PyramidKV compact per layer in one flat allocation (SGLang's fp8 store as uint8
    bytes): an fp8 KV cache is refused at launch with a sentence, not at the first request."""
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    with pytest.raises(ConfigError, match=f"--sparse-method {method} packs each layer's kept rows.*"
                                          f"--kv-cache-dtype {kv_dtype} is not supported with it; drop the flag"):
        sparse_config(["--device", "cpu", "--sparse-method", method, "--kv-cache-dtype", kv_dtype], log=lambda m: None)
    sparse_config(["--device", "cpu", "--sparse-method", method, "--kv-cache-dtype", "bfloat16"], log=lambda m: None)
    sparse_config(["--device", "cpu", "--sparse-method", "snapkv", "--kv-cache-dtype", kv_dtype], log=lambda m: None)


def test_per_layer_methods_refuse_a_checkpoint_fp8_kv_cache_at_start(monkeypatch):
    """An fp8 checkpoint resolves ``--kv-cache-dtype auto`` to fp8 inside SGLang, past the
    launcher: the scheduler's controller refuses the uint8-stored pool before any request."""
    import types

    import torch

    from sglang_sparse.srt import activation
    from sglang_sparse.srt.engine import controller
    from sglang_sparse.srt.state import STATE, SchedulerState

    monkeypatch.setattr(STATE, "scheduler", SchedulerState())
    monkeypatch.setattr(activation, "load_config", lambda: {"method": "pyramidkv"})
    pool = types.SimpleNamespace(dtype=torch.float8_e4m3fn, store_dtype=torch.uint8)
    runner = types.SimpleNamespace(token_to_kv_pool=pool)
    with pytest.raises(RuntimeError, match="pyramidkv compacts per layer.*KV cache is torch.float8_e4m3fn.*"
                                           "pass --kv-cache-dtype bfloat16"):
        controller.ensure_controller(runner)
    assert STATE.scheduler.controller is None


def test_retroinfer_decodes_eagerly_evicts_and_has_no_chains():
    """RetroInfer computes each decode layer in Python (ComputedDecodeView): CUDA graphs off on a
    GPU; its cold rows leave the pool: radix cache off; Chain Cache cannot carry its tiers."""
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    config, argv = sparse_config(["--device", "cuda", "--sparse-method", "retroinfer"], log=lambda m: None)
    assert "--disable-cuda-graph" in argv and "--disable-radix-cache" in argv
    assert argv[argv.index("--attention-backend") + 1] == "triton" and config["chain_cache"] is False
    with pytest.raises(ConfigError, match="--chain-cache on is not supported by --sparse-method retroinfer"):
        sparse_config(["--device", "cpu", "--sparse-method", "retroinfer", "--chain-cache", "on"], log=lambda m: None)


def test_chain_replica_names_the_chains_or_is_refused_with_a_sentence():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    config, argv = sparse_config(["--sparse-method", "snapkv", "--chain-replica", "a1"], log=lambda m: None)
    assert config["chain_replica"] == "a1" and "--chain-replica" not in argv
    assert sparse_config(["--sparse-method", "snapkv"], log=lambda m: None)[0]["chain_replica"] is None
    for bad, words in ((["--sparse-method", "snapkv", "--chain-replica", "r2"], "not a replica name"),
                       (["--sparse-method", "snapkv", "--chain-replica", "A"], "lowercase"),
                       (["--sparse-method", "dense", "--chain-replica", "a"], "Chain Cache is off")):
        with pytest.raises(ConfigError, match=words):
            sparse_config(bad, log=lambda m: None)


def test_tp_size_must_split_the_heads_and_cpu_ranks_get_their_environment(fake_model, monkeypatch):
    """``--tp-size`` that does not split the model's heads stops the launcher with a sentence;
    on a CPU, several ranks get core bindings and (tensor parallel) no NCCL library, unless given."""
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt import launcher

    with pytest.raises(ConfigError, match="--tp-size 2 does not split this model's 9 attention heads and 3 KV"):
        launcher.complete_argv(["--tp-size", "2"], log=lambda m: None)
    (fake_model / "config.json").write_text(json.dumps({**SMOL, "num_attention_heads": 12, "num_key_value_heads": 4}))
    for var in ("SGLANG_CPU_OMP_THREADS_BIND", "SGLANG_NCCL_SO_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(launcher.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(launcher, "_numa_nodes", lambda: 1)
    lines = []
    launcher.complete_argv(["--tp", "2"], log=lines.append)
    assert launcher.os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|2-3"
    assert launcher.os.environ["SGLANG_NCCL_SO_PATH"] == launcher.NO_NCCL
    assert any("SGLANG_CPU_OMP_THREADS_BIND=0-1|2-3" in line for line in lines)
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "3|2")
    monkeypatch.delenv("SGLANG_NCCL_SO_PATH")
    launcher.complete_argv(["--dp-size", "2"], log=lambda m: None)  # data parallel: bindings only
    assert launcher.os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "3|2"
    assert "SGLANG_NCCL_SO_PATH" not in launcher.os.environ
    (fake_model / "config.json").write_text(json.dumps({**SMOL, "num_attention_heads": 8, "num_key_value_heads": 2}))
    launcher.complete_argv(["--tp-size", "4"], log=lambda m: None)  # 4 ranks over 2 KV heads: replicated


def test_quest_select_per_flag_reaches_the_config_or_is_refused():
    from sglang_sparse.config import parse_sparse_args
    from sglang_sparse.registry import ConfigError

    cfg, rest = parse_sparse_args(["--sparse-method", "quest", "--sparse-select-per", "kv_head", "--port", "1"])
    assert cfg["options"]["select_per"] == "kv_head" and rest == ["--port", "1"]
    assert parse_sparse_args(["--sparse-method", "quest"])[0]["options"]["select_per"] == "head"
    with pytest.raises(ConfigError, match="select_per='group' is not allowed"):
        parse_sparse_args(["--sparse-method", "quest", "--sparse-select-per", "group"])
    with pytest.raises(ConfigError, match="has no option select_per"):
        parse_sparse_args(["--sparse-method", "snapkv", "--sparse-select-per", "kv_head"])


def test_sparse_overlap_keeps_sglangs_overlap_scheduler_for_evicting_methods_only():
    from sglang_sparse.registry import ConfigError
    from sglang_sparse.srt.launcher import sparse_config

    def argv_for(*flags):
        return sparse_config(["--device", "cpu", *flags], log=lambda m: None)[1]

    assert "--disable-overlap-schedule" in argv_for("--sparse-method", "rkv")  # off by default
    on = argv_for("--sparse-method", "rkv", "--sparse-overlap", "on")
    assert "--disable-overlap-schedule" not in on and "--sparse-overlap" not in on and "--disable-radix-cache" in on
    assert "--disable-overlap-schedule" not in argv_for("--sparse-method", "dense")  # SGLang's default
    for flags, message in [(("--sparse-method", "rkv", "--sparse-overlap", "yes"), "--sparse-overlap yes is not one of off, on"),
                           (("--sparse-method", "quest", "--sparse-overlap", "on"), "is for methods that evict KV"),
                           (("--sparse-method", "snapkv", "--sparse-overlap", "on"),
                            "not available for --sparse-method snapkv yet"),
                           (("--sparse-method", "h2o", "--sparse-overlap", "on", "--disable-overlap-schedule"),
                            "drop one of them")]:
        with pytest.raises(ConfigError, match=message):
            argv_for(*flags)
