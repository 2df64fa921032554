"""Everything sglang_sparse changes in SGLang, in one table (applied by ``plugin.load``).

Each ``Patch`` names the SGLang target, the handler (``module:attribute`` under
``sglang_sparse.srt``, imported only where the patch applies), the kind, the process it applies
in, the condition, and why. Kinds:

- ``before`` / ``after`` / ``around``: ``HookRegistry.register`` on the target;
- ``attention-backend``, ``radix-backend``: SGLang's registries (the handler is the factory);
- ``route``: ``app.add_api_route`` (``target`` = path, ``methods``);
- ``exception-handler``: ``app.add_exception_handler`` (the handler builds it from SGLang's own);
- ``module-state``, ``model-rebuild``: a one-time change the handler makes when called;
- ``subclass``, ``value-swap``, ``attribute``, ``module-hook`` (a torch forward hook on a module
  of SGLang's model): done inside another patch's handler (``applied_by``); listed so that nothing
  the extension does to SGLang is unlisted.

Conditions: ``cpu`` (CPU serving, even for plain ``sglang.launch_server``: SGLang 0.5.23 needs it
there), ``active`` (a server started by ``sglang_sparse.launch_server``), ``evicting`` (its
method evicts KV), ``flat_kv_pool`` (its method compacts per layer or moves a wave's rows over
every layer at once: one flat KV allocation),
``payload_pool`` (its method keeps KV in its own store: a share of the pool's bytes),
``chain_cache`` (Chain Cache on), ``engine_probe`` (its method prefills a probe after the prompt),
``projects_kv`` (its method replaces the model's K/V projection: Palu's low-rank factors),
``check_integrity``
(``SGLANG_SPARSE_CHECK_INTEGRITY=1``). Every entry was checked against ``SGLANG_VERSION``.
``GET /sparse/info`` lists what each process applied.
"""

from __future__ import annotations

from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"

HOOK_KINDS = ("before", "after", "around")
CALLED_KINDS = ("module-state", "model-rebuild")  # plugin.load calls the handler once
LISTED_KINDS = ("subclass", "value-swap", "attribute", "module-hook")  # done by another patch's handler


@dataclass(frozen=True)
class Patch:
    name: str
    kind: str
    target: str
    handler: str  # "module:attribute" under sglang_sparse.srt ("" for listed kinds)
    process: str  # "all" | "main" | "scheduler"
    when: str  # "cpu" | "active" | "evicting" | "flat_kv_pool" | "payload_pool" | "chain_cache" | "engine_probe"
    #            | "projects_kv" | "check_integrity"
    why: str
    methods: tuple[str, ...] = ()  # routes
    applied_by: str = ""  # listed kinds: the patch whose handler does it

    def describe(self) -> dict:
        out = {"name": self.name, "kind": self.kind, "target": self.target, "why": self.why,
               "checked_against": f"sglang=={SGLANG_VERSION}"}
        if self.handler:
            out["handler"] = f"sglang_sparse.srt.{self.handler}"
        if self.methods:
            out["methods"] = list(self.methods)
        if self.applied_by:
            out["applied_by"] = self.applied_by
        return out


S = "sglang.srt."
SCHED = f"{S}managers.scheduler.Scheduler"
TOKENIZER = f"{S}managers.tokenizer_manager.TokenizerManager"
BATCH = f"{S}managers.schedule_batch.ScheduleBatch"
USAGE = f"{S}entrypoints.openai.usage_processor.UsageProcessor"


def _route(path: str, methods: tuple[str, ...], handler: str, when: str = "active") -> Patch:
    name = f"route:{path}" if methods == ("GET",) else f"route:{methods[0]} {path}"
    return Patch(name, "route", path, handler, "main", when, "an admin route of sglang_sparse (docs/operations.md)",
                 methods=methods)


PATCHES: tuple[Patch, ...] = (
    # -- every SGLang process on a CPU ---------------------------------------------------------------
    Patch("platform:cpu-rotary-plain-torch", "module-state", f"{S}layers.rotary_embedding.base._is_mps",
          "platform:enable_cpu", "all", "cpu",
          "SGLang picks a compiled rotary kernel (vllm._custom_ops) unless the device looks non-CUDA; on a "
          "CPU the scheduler dies importing it. True selects its plain-torch path."),
    # -- scheduler: status -------------------------------------------------------------------------------
    Patch("hook:scheduler-internal-state", "after",
          f"{S}managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state",
          "status:add_scheduler_record", "scheduler", "active",
          "every internal-state readback (/server_info, /sparse/*) carries a record built in the scheduler"),
    # -- scheduler: the engine -----------------------------------------------------------------------------
    Patch("attention-backend:torch_native", "attention-backend", "torch_native", "engine.backends:create_torch_native",
          "scheduler", "active", "SGLang's torch_native backend with the per-layer sparse hooks (the CPU path)"),
    Patch("attention-backend:triton", "attention-backend", "triton", "engine.backends:create_triton",
          "scheduler", "active", "SGLang's Triton backend with the per-layer sparse hooks (the CUDA path)"),
    Patch("hook:forward-step", "around", f"{S}managers.tp_worker.TpModelWorker.forward_batch_generation",
          "engine.steps:around_forward", "scheduler", "active",
          "one StepInfo per forward: begin_step before the model runs, end_step after"),
    Patch("hook:decode-safe-point", "before", f"{BATCH}.prepare_for_decode", "engine.steps:before_prepare_for_decode",
          "scheduler", "active", "planned compactions run between steps; lengths follow resident rows"),
    Patch("hook:prefill-safe-point", "before", f"{SCHED}.get_new_batch_prefill", "engine.steps:before_new_prefill",
          "scheduler", "active",
          "the same safe point before admission (and between a request's prompt chunks); LRU reclaim of idle chains"),
    Patch("hook:release-kv", "before", f"{S}mem_cache.common.release_kv_cache", "engine.steps:before_release",
          "scheduler", "active", "a request leaves: park its chain, drop its method state before SGLang frees rows"),
    Patch("hook:decode-positions", "before", f"{S}model_executor.model_runner.ModelRunner.forward",
          "engine.rows:before_model_forward", "scheduler", "active",
          "RoPE positions stay logical for rows with evicted or pruned tokens before them (eager and graphs)"),
    Patch("hook:flat-kv-pool", "around", f"{S}mem_cache.memory_pool.MHATokenToKVPool._create_buffers_normal",
          "engine.flat_pool:around_create_buffers", "scheduler", "flat_kv_pool",
          "allocate every layer's K (and V) as one tensor, so a layer's kept rows can live in cells of "
          "another layer's part and per-layer budgets free whole slots (docs/kv_payload.md), and a wave "
          "of evictions moves and reads every layer's rows in one launch (R-KV, H2O)"),
    Patch("hook:payload-pool-size", "around", f"{S}model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
          "engine.payload_pool:around_pool_sizes", "scheduler", "payload_pool",
          "a method with its own KV store (KIVI) gets its share of the pool's bytes; SGLang keeps the rest as slots"),
    Patch("hook:payload-pool-size-tokens", "around",
          f"{S}model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes_from_max_tokens",
          "engine.payload_pool:around_pool_sizes_from_max_tokens", "scheduler", "payload_pool",
          "the same split when the pool is given in tokens (--max-total-tokens)"),
    Patch("hook:extend-rows", "after", f"{BATCH}.prepare_for_extend", "engine.rows:after_prepare_for_extend",
          "scheduler", "active", "an extend after fewer rows than logical tokens: slots move to the real rows"),
    Patch("hook:latent-projection", "after", f"{S}model_executor.model_runner.ModelRunner.load_model",
          "engine.projection:after_load_model", "scheduler", "projects_kv",
          "once the weights are loaded (before the pool, backends and CUDA graphs): load the method's low-rank K/V "
          "factors and install the qkv_proj forward hooks (engine/projection.py)"),
    Patch("module-hook:qkv-proj", "module-hook",
          f"{S}models.llama.LlamaAttention.qkv_proj (any attention with qkv_proj, q_size, kv_size, rotary_emb)", "",
          "scheduler", "projects_kv",
          "torch forward hook: the K and V columns of qkv_proj's output replaced by the low-rank reconstruction "
          "h B (h = x A), before the model's split, RoPE and KV write", applied_by="hook:latent-projection"),
    # -- scheduler: admission by the MemoryOracle (methods that evict) ---------------------------------
    Patch("hook:admission-oracle", "after", f"{SCHED}.get_prefill_adder_class",
          "engine.admission:after_get_prefill_adder_class", "scheduler", "evicting",
          "PrefillAdder reserves retained + decode rows (the MemoryOracle), not prompt + max_new"),
    Patch("subclass:prefill-adder", "subclass", f"{S}managers.schedule_policy.PrefillAdder", "", "scheduler",
          "evicting", "OracleAdmission<PrefillAdder>: budget checks and reservations from the MemoryOracle",
          applied_by="hook:admission-oracle"),
    Patch("value-swap:ignore-eos", "value-swap", "Req.sampling_params.ignore_eos", "", "scheduler", "evicting",
          "False during PrefillAdder.add_one_req: SGLang's ignore-eos arithmetic hands back logical lengths",
          applied_by="hook:admission-oracle"),
    Patch("hook:arrival-oracle", "around",
          f"{S}mem_cache.allocator.base.BaseTokenToKVPoolAllocator.max_new_tokens_for_memory",
          "engine.admission:around_max_new_tokens_for_memory", "scheduler", "evicting",
          "max_new_tokens clipped by what the request holds after compaction, not its prompt"),
    Patch("hook:request-length", "around", f"{SCHED}.init_req_max_new_tokens",
          "engine.admission:around_init_req_max_new_tokens", "scheduler", "evicting",
          "an evicting request's logical length is bounded by the context, not the pool"),
    Patch("value-swap:max-req-len", "value-swap", f"{SCHED}.max_req_len", "", "scheduler", "evicting",
          "the model's context during init_req_max_new_tokens", applied_by="hook:request-length"),
    # -- scheduler: the prefix cache --------------------------------------------------------------------------
    Patch("radix-cache-backend:sglang_sparse", "radix-backend", "sglang_sparse", "cache.radix:create", "scheduler",
          "active", "the logical radix tree over retained slots (selected with --radix-cache-backend)"),
    Patch("subclass:radix-cache", "subclass", f"{S}mem_cache.unified_radix_cache.UnifiedRadixCache", "", "scheduler",
          "active", "SparseRadixCache: SGLang's cache built disabled as a shell, its tree replaced",
          applied_by="radix-cache-backend:sglang_sparse"),
    # -- scheduler: pruning, admin -------------------------------------------------------------------------
    Patch("hook:prune-probe", "after", f"{SCHED}._create_generation_req", "prune.scheduler:after_create_req",
          "scheduler", "active", "a /prune scoring probe is tagged: no chain, never inserted into the tree"),
    Patch("hook:prune-probe-rows", "after", f"{BATCH}.prepare_for_extend", "prune.scheduler:after_prepare_for_extend",
          "scheduler", "active", "which req_to_token rows are probes (attention sees rows, not requests)"),
    Patch("hook:admin-control", "around", f"{SCHED}.handle_dumper_control", "admin.dispatch:around_dumper_control",
          "scheduler", "active", "typed admin operations (chains, pruning, prefixes) ride dumper-control"),
    # -- scheduler: Chain Cache ---------------------------------------------------------------------------
    Patch("hook:chain-arrival", "after", f"{SCHED}._create_generation_req", "chains.scheduler:after_create_req",
          "scheduler", "chain_cache", "a request's chain is created or resumed (errors finish it with a status)"),
    Patch("hook:chain-cancel-waiting", "before", f"{SCHED}._release_aborted_request",
          "chains.scheduler:before_release_aborted", "scheduler", "chain_cache",
          "a request aborted before it ran invalidates its chain (and frees rows lent to it)"),
    Patch("hook:chain-abort", "after", f"{SCHED}.abort_request", "chains.scheduler:after_abort_request",
          "scheduler", "chain_cache", "an abort invalidates the chain at once (a retry gets 410, not 409)"),
    Patch("hook:chain-sessions", "after", f"{SCHED}.close_session", "chains.scheduler:after_close_session",
          "scheduler", "chain_cache", "closing an SGLang session drops its chain"),
    # -- scheduler: observability -----------------------------------------------------------------------
    Patch("hook:integrity-every-step", "after", f"{SCHED}.process_batch_result",
          "cache.integrity:after_process_batch_result", "scheduler", "check_integrity",
          "the slot census after every processed batch (debug, tests)"),
    Patch("hook:metrics-step", "after", f"{SCHED}.process_batch_result", "metrics:after_process_batch_result",
          "scheduler", "active", "Prometheus series refreshed at most once a second (with --enable-metrics)"),
    Patch("hook:metrics-idle", "after", f"{SCHED}.on_idle", "metrics:after_on_idle", "scheduler", "active",
          "the last step's state exported once the scheduler goes idle"),
    # -- HTTP process: requests -------------------------------------------------------------------------
    Patch("hook:engine-probe-first-token", "around", f"{S}managers.schedule_batch.Req.update_finish_state",
          "engine.probe:around_update_finish_state", "scheduler", "engine_probe",
          "the prompt's last token, forced after the probe, moves from the output into the prompt (engine/probe.py)"),
    Patch("hook:prompt-checks", "before", f"{TOKENIZER}._validate_one_request", "api.generate:before_validate_one_request",
          "main", "active", "empty prompts and ids outside the vocabulary kill SGLang 0.5.23's scheduler"),
    Patch("hook:stream-refusals", "around", f"{TOKENIZER}.generate_request", "api.generate:around_generate_request",
          "main", "active", "notes a refusal before the first output; aborts a chain request whose client left"),
    Patch("hook:generate-route", "around", f"{S}entrypoints.http_server.serve_generate_request",
          "api.generate:around_serve_generate", "main", "active",
          "/generate fields SGLang uses unchecked, chain_id, streamed refusals answered like plain ones"),
    Patch("hook:generate-contract-field", "around", f"{S}entrypoints.api_contract.generate_contract_error",
          "api.generate:around_contract_error", "main", "active", "SGLang's schema errors name their field"),
    Patch("hook:openai-route", "around", f"{S}entrypoints.openai.serving_base.OpenAIServingBase.handle_request",
          "api.generate:around_openai_request", "main", "active", "OpenAI n, chain_id, streamed refusals"),
    Patch("hook:weights-from-disk", "around", f"{TOKENIZER}.update_weights_from_disk",
          "api.weights:around_update_from_disk", "main", "projects_kv",
          "factors computed from the starting weights would go stale: 400 with a sentence (api/weights.py)"),
    Patch("hook:weights-from-tensor", "around", f"{TOKENIZER}.update_weights_from_tensor",
          "api.weights:around_update_weights", "main", "projects_kv", "as from disk"),
    Patch("hook:weights-from-distributed", "around", f"{TOKENIZER}.update_weights_from_distributed",
          "api.weights:around_update_weights", "main", "projects_kv", "as from disk"),
    Patch("hook:weights-from-ipc", "around", f"{TOKENIZER}.update_weights_from_ipc",
          "api.weights:around_update_weights", "main", "projects_kv", "as from disk"),
    Patch("exception-handler:request-validation", "exception-handler", "fastapi.exceptions.RequestValidationError",
          "api.generate:validation_handler", "main", "active",
          "SGLang's handler puts the endpoint's file path and line into the message"),
    Patch("exception-handler:routing", "exception-handler", "starlette.exceptions.HTTPException",
          "api.generate:routing_error_handler", "main", "active",
          "404 / 405 from routing carry no sentence; others go to SGLang's handler"),
    # -- HTTP process: Chain Cache fields -----------------------------------------------------------------
    Patch("hook:chain-meta-info", "around", f"{TOKENIZER}.update_request_meta_info",
          "chains.http:around_update_meta_info", "main", "chain_cache", "chain fields into meta_info"),
    Patch("hook:chain-stream-usage", "around", f"{TOKENIZER}.generate_request", "chains.http:around_generate_request",
          "main", "chain_cache", "a streamed response remembers its chain fields for the usage chunk"),
    Patch("hook:chain-openai-usage", "after", f"{USAGE}.calculate_response_usage", "chains.http:after_response_usage",
          "main", "chain_cache", "chain fields in OpenAI usage"),
    Patch("hook:chain-openai-stream-usage", "after", f"{USAGE}.calculate_streaming_usage",
          "chains.http:after_streaming_usage", "main", "chain_cache", "chain fields in the streamed usage chunk"),
    Patch("model-rebuild:usage-info", "model-rebuild", f"{S}entrypoints.openai.protocol.UsageInfo",
          "chains.http:allow_usage_fields", "main", "chain_cache",
          "UsageInfo ignores extra attributes; rebuilt with extra='allow' (and the responses embedding it)"),
    # -- HTTP process: routes ------------------------------------------------------------------------------
    _route("/sparse/info", ("GET",), "status:sparse_info"),
    _route("/sparse/stats", ("GET",), "status:sparse_stats"),
    _route("/sparse/requests/{rid}/retention", ("GET",), "status:request_retention"),
    _route("/prune", ("POST",), "prune.http:prune"),
    _route("/prune/{prune_id}", ("GET",), "prune.http:get_prune"),
    _route("/prefix/inspect", ("POST",), "prune.http:inspect_prefix"),
    _route("/prefix/priority", ("POST",), "prune.http:prefix_priority"),
    _route("/prefix/delete", ("POST",), "prune.http:delete_prefix"),
    _route("/chain", ("GET",), "status:list_chains", "chain_cache"),
    _route("/chain/{chain_id}", ("GET",), "status:get_chain", "chain_cache"),
    _route("/chain/{chain_id}", ("DELETE",), "status:delete_chain", "chain_cache"),
    _route("/chain/{chain_id}/retention", ("GET",), "status:chain_retention", "chain_cache"),
    # -- the one attribute on SGLang objects ---------------------------------------------------------------
    Patch("attribute:req.sparse", "attribute", f"{S}managers.schedule_batch.Req.sparse", "", "scheduler", "active",
          "sglang_sparse's per-request state (state.ReqSparse); the only attribute set on SGLang's objects"),
)
