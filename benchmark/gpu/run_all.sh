#!/usr/bin/env bash
# The GPU machine's whole job in one go (run from the checkout root there, with .gpu/ and
# .gpumodel/ carried; benchmark/gpu/prepare.sh makes them here). Each stage writes under $OUT:
# GPU tests, in stages that each fit one call (times measured on the H200, 2026-12-02):
#   tests-kernels   every Triton kernel == its reference (quant, sparse, reference, Quest pages,
#                   FlashPrefill)  ~2 min
#   tests-server    dense graphs == plain SGLang == eager, /prune with graphs == eager       ~5 min
#   tests-quest     Quest pages through the kernel, Quest graphs == eager                    ~4 min
#   tests-snapkv    SnapKV graphs == eager, SnapKV compaction on the GPU pool                ~4 min
#                   (the two together took 453 s in one call, 2026-12-02)
#   tests-payload   StreamingLLM and PyramidKV servers in graphs == eager                   ~6 min
#   tests-kivi      KIVI servers: graphs == eager, chain resume, radix-cache hit            ~5.5 min
#   tests-new-kernels  TurboQuant's and FlashPrefill's kernels == references (issue 17)
#   tests-turboquant  TurboQuant server: graphs == eager through its Triton kernel (not yet run)
#   tests-omnikv    OmniKV kernels == references; OmniKV graphs == eager                  ~4 min
#   tests-compile   dense, Quest and OmniKV with --enable-torch-compile == eager (dense passed;
#                   Quest and OmniKV not yet completed on a GPU)
#   tests-online    H2O and R-KV: scores accumulated inside the decode graphs == eager evictions
#   tests-skipkv    SkipKV alone of the above (~2 min)
#   tests-kvzip     KVzip: probe + compaction on the GPU, graphs == eager (~3 min, est.)
#   tests-retroinfer  RetroInfer: eager decode through the pinned host tier and page cache, all clusters == dense (200 s, 2026-12-04)
#   matched-retroinfer  RetroInfer at 32K, batch 1 / 2, next to dense tuned over 16 / 64 splits (271 s, 2026-12-04,
#                   before the page cache: RetroInfer measured nothing, its Python-LRU retrieval decoded at ~0.2 tok/s)
#   capacity128k-retroinfer  RetroInfer vs dense (32 / 64 splits) at 128K with the same device memory (525 s, 2026-12-04)
#   tests-compile-quest  Quest alone with --enable-torch-compile == eager (a 400 s start allowed)
# Benchmarks:
#   kernels   sgl-kernel-sparse microbenchmarks (bandwidth against the HBM ceiling)      ~2 min
#   kernels-quest128k  Quest's served decode kernels at 128K (fold, paged scores, select_top, paged decode),
#                   and the attention-sums kernel at an H2O prompt chunk (15 s, 2026-12-05)
#   kernels-quest128k-sweep  the paged attention at 128K over block_n x num_splits (choose its 128K default)
#   tune-quest      issue 15: Quest's served decode stages at 128K, batch 4 / 1 / 2 (4 first: the 2.5x target), each timed as CUDA-graph
#                   replays over 8 distinct layers for every launch option (scores: block_p x warps; selection:
#                   bits / nibble / radix x warps x chunk; attention: splits x block_n x warps x prefetch / pipelining),
#                   then the whole layer default vs tuned; writes $OUT/<GPU name>.json (copy it to
#                   sgl-kernel-sparse/python/sgl_kernel_sparse/configs/ and the server uses it) (~8 min, est.)
#   tune-quest-serve  tune-quest at batch 4 / 1 (150 s cap); its table, exported as SGL_KERNEL_SPARSE_TUNING,
#                   serves the stages after it in the same run_all.sh; then the selection kernels' GPU tests
#   tune-select     the selection stages of tune-quest alone (bits / radix / nibble) (~2 min, est.)
#   tests-tuned-kernels  the paged kernel's launch variants, the GQA kernel of --sparse-select-per kv_head and the three
#                   selection kernels == references on the GPU, and Quest's pages in a captured CUDA graph
#   capacity  8B shape, 32K in / 2K out: largest resident batch, dense vs SnapKV(2048)   ~7 min
#   capacity393k  the same at a 393,216-token pool: SnapKV (batch 89), then dense over 16/32 splits ~9.5 min
#   capacity393k-rkv  R-KV (166 resident) then dense (16 splits) at the 393,216 pool, through bg.sh (~20 min, est.)
#   capacity-rkv-step  R-KV's decode step at those rows per request, 4K prompts (179 resident, ~3 min, est.)
#   capacity-rkv-step-splits  the same over R-KV's own kv splits 2 / 4 / 8 (~8 min, est.; the best goes to
#                   capacity393k-rkv-h100 as RKV_SPLITS=N, which otherwise runs R-KV at SGLang's default 8)
#   profile-rkv-step  R-KV's decode steps at those rows, kernel by kernel, over its scored window and one decode
#                   eviction (batch 179, 4K prompts; ~3 min, est.)
#   profile-rkv-overlap  profile-rkv-step's R-KV without and with --sparse-overlap on (~5 min, est.;
#                   PROFILE_VARIANTS=rkv-overlap: only with it)
#   profile-capacity-dense  dense's decode step at capacity393k's batch (11 x 32K, 16 splits), kernel by kernel
#                   (~3 min, est.): the other side of profile-rkv-step
#   tests-decode-scores  the decode scoring kernel at R-KV's capacity shape, the eviction wave's redundancy kernel and
#                   compaction on the device; H2O / R-KV graph == eager (~6 min, est.)
#   tests-wave      tests-decode-scores without its server tests (~1 min, est.)
#   capacity393k-rkv-h100  the same on an H100 (--mem-fraction-static 0.92, graphs for each own batch only; dense at 16 / 32 splits,
#                   DENSE_SPLITS="16" for one; 825 s, 2026-12-06; CAP_METHODS="rkv-overlap rkv dense": R-KV under
#                   the overlap scheduler too, ~24 min)
#   capacity-rkv-overlap  capacity393k-rkv-h100 at a CAP_POOL-token pool (default 196,608; CAP_METHODS default
#                   "rkv-overlap dense"; ~9 min at 196,608, est.; CAP_POOL=98304: ~6 min, est.)
#   capacity-eviction  R-KV, SnapKV and dense (16 splits) at a 98,304-token pool               ~6 min
#   capacity-kvzip  KVzip's kernel test, then KVzip (probe at 32K: 65K rows while it runs), dense
#                   (16 / 64 splits), SnapKV, 98,304 pool (~8 min, est.)
#   capacity-kvzip-chain  issue 16: KVzip compresses each 32K prompt once and parks it as a chain, then
#                   all resume and decode together; dense (16 / 64 splits), SnapKV; 98,304 pool (~9 min, est.)
#   agent-replay9-a / -b  the 9-turn replay with dense tuned in the session's consecutive calls: (a) SnapKV +
#                   chain, dense + radix at 16 splits with --enable-torch-compile (dense first); (b) dense + radix at 32
#                   splits, then tests-retroinfer; merge: bench_agent_replay.py --merge (~9 min each, est.)
#   capacity-payload-equal  issue 17 after the pool-split fix (7a3313b): Palu 0.5 / 0.75, TurboQuant 3-bit and
#                   dense (16 / 64 splits) with the same KV bytes (check kv_bytes_total), 196,608 pool (551 s, 2026-12-05)
#   capacity-online-all  issue 16: capacity-online's five methods in one run (dense 16 / 64 splits, H2O,
#                   SkipKV, SnapKV, then R-KV), 49,152 pool (520 s, 2026-12-05)
#   agent-replay-more  issue 16: the 4-turn replay for SkipKV and KVzip + chain, dense + radix (16 / 32 splits)
#                   in the same call (~7 min, est.)
#   matched   8B shape, 32K: plain SGLang vs dense vs Quest(2048) at batch 1 2 4 8       ~8 min
#   matched128k-dense   8B shape, 128K, batch 1 2 4: dense tuned over 32 / 64 kv splits  ~9 min
#   matched128k-sparse  the same prompts: Quest(2048) and OmniKV(2048)                   ~9 min
#   matched128k-quest   the same, dense and Quest(2048) in one call, both at 64 kv splits   ~9 min
#                   (with a committed configs/NVIDIA_H200.json from tune-quest, Quest runs its tuned kernels)
#   matched128k-omnikv  the same for OmniKV(2048): dense and OmniKV in one call, both at 64 kv splits
#   matched128k-omnikv-b12  the same at batch 1 and 2 only (fits an H100) (~6 min, est.)
#   matched128k-quest-kv  the same for Quest with one page set per KV head (--sparse-select-per kv_head)
#   matched128k-compile-dense / -quest  the same with --enable-torch-compile, one server per call
#   matched128k-compile-quest-b1  compiled Quest at batch 1 only (its 1/2/4 graph capture outran 420 s)
#   matched128k-compile-quest-b4  compiled Quest at batch 4 only (one capture size), for issue 15's 2.5x (~7 min, est.)
#   matched128k-compile-kv-b4  compiled dense, then compiled Quest --sparse-select-per kv_head, batch 4 only,
#                   both at 64 splits, one run (768 s on the H200, 2026-12-05: longer than one call, see benchmark/gpu/bg.sh)
#   matched128k-compile-kv-b1  the same at batch 1 (270,336-token pool, one prompt) (~9 min, est.)
#   matched128k-compile-kv-b12  the same at batch 1 and 2, one server each (fits an H100) (~15 min, est.)
#   matched128k-compile-omnikv-b4 / -b12  the same pair with OmniKV(2048) instead of Quest (through bg.sh,
#                   ~13 min / ~15 min, est.; not yet run)
#   agent-replay-dense / -evict  issue 16's agent replay (8B shape, 32 sessions x 4 turns, 4K system,
#                   2K tool outputs, 98,304-token pool): dense + radix over 8 / 16 splits in the
#                   first call; SnapKV, H2O and R-KV (budget 2,048) + Chain Cache in the second
#   agent-replay8-dense / -evict  the same over 8 turns: dense + radix (8 / 16 splits); SnapKV + chain
#   agent-replay8   both in one call: SnapKV + chain (200 s cap), dense + radix at 16 splits (390 s cap)
#   overhead-compile  plain SGLang vs dense through sglang_sparse at 32K, batch 1 and 8, both with
#                   --enable-torch-compile at 16 kv splits (issue 15's < 3% overhead; 354 s on the H200, 2026-12-06)
#   profile-overhead  where a batch-1 decode step's time goes, plain vs dense through sglang_sparse, both
#                   compiled at 16 splits, 8K prompt, one server at a time, SGLang's /start_profile over 40
#                   steps; prints kernels and host ops per step side by side (benchmark/profile_decode.py, ~7 min, est.)
#   kernels-omnikv  OmniKV's decode kernels: GPU tests against the references, then bench_kernels --only omnikv (~1 min, est.)
#   tune-gqa        the GQA paged kernel (--sparse-select-per kv_head): a plain loop / Triton pipelining / slots a
#                   tile ahead (prefetch); GPU tests, bench_kernels --only gqa --sweep (128K batch 1 / 4, 32K batch
#                   32), then the sweep as the server runs it (128K, batch 4 / 1) with its % of HBM (79 s, 2026-12-06, H100)
#   profile-omnikv-b1 / -b4  OmniKV's compiled decode step at 128K next to dense's, kernel by kernel
#                   (benchmark/profile_decode.py, batch 1 fits an H100 ~6 min; batch 4 H200 only, ~11 min, est.)
#   overhead-compile-b8  the same at batch 8 only, dense first, a 128-token window (237 s on a warm
#                   inductor cache, 2026-12-06: run it after overhead-compile in the same machine's life)
#   overhead-alt    the same pair with repetitions: benchmark/bench_overhead.py keeps both compiled servers
#                   up at once (fits an H100) (--sleep-on-idle) and measures them in alternation A B B A ..., 6 reps of
#                   batch 1 and 8 at 8K prompts (shorter steps than 32K: a per-step cost weighs more),
#                   medians (~6 min on a warm inductor cache, est.)
#   capacity-online  issue 16's table at a 49,152-token pool, 8,192-token prefill chunks: dense
#                   (16 / 64 splits), H2O, SkipKV, SnapKV, R-KV (~8 min, est.)
#   prefill-flash  issue 17: prefill speed (TTFT of one request, 1 output token), 32K and 128K
#                   prompts, FlashPrefill (threshold 0.9) then dense, 16,384-token chunks (258 s, 2026-12-03)
#   capacity-turboquant  issue 17: TurboQuant 3-bit vs dense (16 / 64 splits), 196,608-token pool (~8 min, est.)
#   capacity-palu75 Palu kernel sweep, then Palu at ratio 0.75 alone, same pool (~5 min, est.)
#   kernels-quant   KIVI and TurboQuant decode kernels alone (~1 min, est.)
#   save-cache      last: pack the torch.compile / Triton caches into $OUT/compile_cache.tar.xz if
#                   it is at most 15 MiB (benchmark/gpu/compile_cache.sh; carry it back as .gpucache)
#   capacity-palu   issue 17: Palu kernel tests and timing on the GPU, then Palu (ratio 0.5) vs dense (16 / 64 splits), 196,608-token pool (~9 min, est.)
#   prefill-flash-keepall  FlashPrefill at 1.0 (all blocks) next to dense, 32K and 128K (~6 min, est.)
#   (each 128K server prefills 4 prompts, ~45 s each, so two servers fill one call)
# One call holds at most 10 minutes: give stages whose times add up to well under that, e.g.
#   bash benchmark/gpu/run_all.sh tests-kernels tests-kivi
# Each stage prints its name, start time and, when it ends, how long it took.
set -uo pipefail
cd "$(dirname "$0")/../.."
. benchmark/gpu/env.sh
OUT=${OUT:-/tmp/sglang_sparse_out}
mkdir -p "$OUT"
M8=.gpumodel/qwen3-8b-shape
LONG=(--model-path "$M8" --pool 196608)
gpu_tests() {  # name, pytest arguments...
  local name=$1; shift
  # cut at GPU_TEST_TIMEOUT seconds so the summary still reaches $OUT inside one call
  timeout "${GPU_TEST_TIMEOUT:-560}" python3 -m pytest -q -m gpu -rA "$@" 2>&1 | tail -40 | tee "$OUT/gpu_$name.txt"
}
tune_quest() {  # cap s, time limit s, batches...: Quest's decode kernels at 128K, budget 2,048; table into $OUT
  local cap=$1 limit=$2; shift 2
  timeout "$cap" python3 benchmark/gpu/tune_quest_kernels.py --batch "$@" --ctx 131072 --budget 2048 \
    --time-limit "$limit" --out "$OUT/quest_tuning_128k.json" --write-config-dir "$OUT" 2>&1 | tee "$OUT/$stage.txt"
}
for stage in "$@"; do
  echo "=== $stage $(date -u +%T)"
  start=$SECONDS
  case $stage in
    tests-kernels)
      gpu_tests "$stage" test/test_quant_kernels.py test/test_turboquant_kernel.py test/test_sparse_kernels.py \
        test/test_reference_kernels.py test/test_quest_pages.py test/test_flashprefill_kernels.py \
        test/test_attn_sums_kernel.py ;;
    tests-server)
      gpu_tests "$stage" test/test_gpu_server.py -k "dense_with or prune" ;;
    tests-quest)
      gpu_tests "$stage" test/test_gpu_server.py -k "quest" ;;
    tests-snapkv)
      gpu_tests "$stage" test/test_gpu_server.py -k "snapkv" ;;
    tests-payload)
      gpu_tests "$stage" test/test_gpu_payload.py -k "streamingllm or pyramidkv" ;;
    tests-kivi)
      gpu_tests "$stage" test/test_gpu_payload.py -k kivi ;;
    tests-new-kernels)  # the kernels of issue 17 alone (also part of tests-kernels)
      gpu_tests "$stage" $(ls test/test_turboquant_kernel.py test/test_flashprefill_kernels.py 2>/dev/null) ;;
    tests-turboquant)
      gpu_tests "$stage" test/test_gpu_payload.py -k turboquant ;;
    matched-retroinfer)  # issue 15: RetroInfer (eager decode, pinned host tier) next to tuned dense, 32K, batch 1 / 2
      timeout 560 python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 32768 --output-len 64 \
        --batches 1 2 --methods retroinfer dense --tune dense --kv-splits 16 64 --timeout 240 \
        --out "$OUT/long_matched_32k_retroinfer.json" -- --cuda-graph-bs-decode 1 2 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity128k-retroinfer)  # issue 15: largest resident batch at 128K, dense (32 / 64 splits) vs RetroInfer
      # with the same device memory (its 2 GiB page cache and 5 GiB index budget come out of its pool)
      timeout 590 python3 benchmark/bench_long_context.py capacity "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --budget 1024 --methods dense retroinfer --tune dense --kv-splits 32 64 --retro-host-mb 80000 \
        --retro-cache-rows 4194304 --retro-index-mb 5120 --timeout 300 \
        --out "$OUT/long_capacity_128k_retroinfer.json" -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    tests-retroinfer)  # issue 15: RetroInfer's eager decode, pinned host tier and page cache on CUDA (200 s)
      gpu_tests "$stage" test/test_gpu_payload.py -k retroinfer ;;
    tests-omnikv)
      gpu_tests "$stage-kernels" test/test_sparse_kernels.py -k omnikv
      gpu_tests "$stage" test/test_gpu_server.py -k "omnikv and not torch_compile" ;;
    tests-compile)
      gpu_tests "$stage" test/test_gpu_server.py -k "torch_compile" ;;
    tests-online)
      gpu_tests "$stage" test/test_gpu_server.py -k "online" ;;
    tests-decode-scores)  # the decode-step scoring kernel (H2O / R-KV / SkipKV) at R-KV's capacity shape, timed
      # next to the torch path it replaces; then H2O's and R-KV's graph decode == eager through the server
      gpu_tests "$stage-kernel" -s test/test_decode_scores_kernel.py
      # R-KV's eviction waves: the redundancy kernel (timed next to the reference) and the wave's
      # compaction with its positions kept on the device (== the CPU's)
      gpu_tests "$stage-wave" -s test/test_rkv_redundancy_kernel.py test/test_contract_core.py
      gpu_tests "$stage" test/test_gpu_server.py -k "online and (h2o or rkv)" ;;
    tests-wave)  # tests-decode-scores without its server tests (~1 min): the scoring and redundancy kernels
      # next to their references, and the wave's compaction on the device == the CPU's
      gpu_tests "$stage-kernel" -s test/test_decode_scores_kernel.py
      gpu_tests "$stage" -s test/test_rkv_redundancy_kernel.py test/test_contract_core.py \
        test/test_sparse_kernels.py -k "redundancy or compact or contract" ;;
    capacity-rkv-step)  # R-KV's decode step at capacity393k-rkv's rows per request (budget 2,048 + interval 128)
      # with 4K prompts instead of 32K, so 179 fill the 393,216 pool in ~1 min of prefill (0.92: an 80 GB card)
      timeout 420 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 393216 \
        --prompt-len 4096 --output-len 2048 --methods rkv --graphs-own-batch --timeout 300 \
        --out "$OUT/long_capacity_4k_393k_rkv_step.json" -- --mem-fraction-static 0.92 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-rkv-step-splits)  # capacity-rkv-step over R-KV's own kv-split cap 2 / 4 / 8 (8: SGLang's default, what every
      # R-KV capacity row so far ran at; SGLang picks each request's splits up to the cap from the batch and
      # lengths, so the cap may matter little at 179 x ~2.1K rows: this measures it) (~8 min, est.)
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 393216 \
        --prompt-len 4096 --output-len 2048 --methods rkv --kv-splits-for rkv=2,4,8 --graphs-own-batch --timeout 300 \
        --out "$OUT/long_capacity_4k_393k_rkv_step_splits.json" -- --mem-fraction-static 0.92 2>&1 | tee "$OUT/$stage.txt" ;;
    profile-rkv-step)  # where R-KV's decode step goes at capacity393k-rkv's rows per request: batch 179, 4K
      # prompts, the 393,216-token pool (0.92: an 80 GB card), with the decode scoring kernel (~3 min, est.).
      # Steps 118-134 of every request: its buffer's 8 scored queries (rows 2,168-2,175) and the decode
      # eviction at 2,176 rows (all 179 at once: they decode in step)
      timeout 420 python3 benchmark/profile_decode.py --model-path "$M8" --variants rkv --batch 179 \
        --prompt-len 4096 --steps 16 --warmup-tokens 118 --max-total-tokens 393216 --start-timeout 300 \
        --variant-flags rkv="--sparse-method rkv --sparse-budget 2048 --sparse-interval 128 --chain-cache off" \
        --out "$OUT/profile_rkv_step_b179.json" -- --load-format dummy --attention-backend triton \
        --sampling-backend pytorch --mem-fraction-static 0.92 --cuda-graph-backend-prefill disabled \
        --cuda-graph-bs-decode 179 --context-length 6208 2>&1 | tee "$OUT/$stage.txt" ;;
    profile-rkv-overlap)  # profile-rkv-step with and without SGLang's overlap scheduler (--sparse-overlap on),
      # one server each, the same 16 steps over the scored window and one eviction wave (~5 min, est.)
      R="--sparse-method rkv --sparse-budget 2048 --sparse-interval 128 --chain-cache off"
      timeout 560 python3 benchmark/profile_decode.py --model-path "$M8" --variants ${PROFILE_VARIANTS:-rkv rkv-overlap} --batch 179 \
        --prompt-len 4096 --steps 16 --warmup-tokens 118 --max-total-tokens 393216 --start-timeout 300 \
        --variant-flags rkv="$R" rkv-overlap="$R --sparse-overlap on" \
        --out "$OUT/profile_rkv_overlap_b179.json" -- --load-format dummy --attention-backend triton \
        --sampling-backend pytorch --mem-fraction-static 0.92 --cuda-graph-backend-prefill disabled \
        --cuda-graph-bs-decode 179 --context-length 6208 2>&1 | tee "$OUT/$stage.txt" ;;
    profile-capacity-dense)  # dense's decode step at capacity393k-rkv's dense batch: 11 requests of 32K, the
      # 393,216-token pool (0.92: an 80 GB card), 16 kv splits (its best there) (~3 min, est.)
      timeout 420 python3 benchmark/profile_decode.py --model-path "$M8" --variants dense --batch 11 \
        --prompt-len 32768 --steps 20 --warmup-tokens 16 --max-total-tokens 393216 --start-timeout 300 \
        --out "$OUT/profile_capacity_dense_b11.json" -- --load-format dummy --attention-backend triton \
        --sampling-backend pytorch --mem-fraction-static 0.92 --cuda-graph-backend-prefill disabled \
        --cuda-graph-bs-decode 11 --context-length 36864 --triton-attention-num-kv-splits 16 2>&1 | tee "$OUT/$stage.txt" ;;
    tests-compile-quest)  # start_server allows 400 s; the whole stage is cut at 420 s
      timeout 420 python3 -m pytest -q -m gpu -rA test/test_gpu_server.py \
        -k "torch_compile and quest" 2>&1 | tail -40 | tee "$OUT/gpu_$stage.txt" ;;
    kernels)
      python3 sgl-kernel-sparse/bench/bench_kernels.py --out "$OUT/kernels.json" --no-ref 2>&1 | tee "$OUT/kernels.txt" ;;
    kernels-omnikv)  # issue 15: OmniKV's two decode kernels against their references on the GPU, then timed
      # (the rows + tail kernel serves a GQA group per program since 2026-12-06) (~1 min, est.)
      timeout 240 python3 -m pytest -q -m gpu test/test_sparse_kernels.py -k omnikv 2>&1 | tee "$OUT/gpu_tests_omnikv.txt"
      timeout 200 python3 sgl-kernel-sparse/bench/bench_kernels.py --only omnikv --out "$OUT/kernels_omnikv.json" \
        2>&1 | tee "$OUT/$stage.txt" ;;
    tune-gqa)  # issue 15's >= 80% of HBM for the paged kernel, on the GQA kernel (see the list above)
      gpu_tests "$stage" test/test_sparse_kernels.py -k paged_gqa
      timeout 200 python3 sgl-kernel-sparse/bench/bench_kernels.py --only gqa --sweep --iters 50 \
        --out "$OUT/kernels_gqa.json" 2>&1 | tee "$OUT/$stage.txt"
      timeout 300 python3 benchmark/gpu/tune_quest_kernels.py --batch 4 1 --ctx 131072 --budget 2048 \
        --stages paged_gqa_decode_attention --time-limit 200 --out "$OUT/gqa_tuning_128k.json" 2>&1 | tee -a "$OUT/$stage.txt" ;;
    kernels-quest128k)  # issue 15: Quest's served decode kernels one by one at 128K, batch 1 / 4, and attn_sums (15 s, 2026-12-05)
      timeout 200 python3 sgl-kernel-sparse/bench/bench_kernels.py --only quest128k attn_sums \
        --out "$OUT/kernels_quest128k.json" 2>&1 | tee "$OUT/$stage.txt" ;;
    tune-quest)  # issue 15: choose the launch options of Quest's decode kernels (see the list above)
      tune_quest 580 400 4 1 2 ;;
    tune-quest-serve)  # issue 15: tune-quest at batch 4 and 1 only; its table (in $OUT: commit it to configs/)
      # is exported as SGL_KERNEL_SPARSE_TUNING, so the servers of later stages of this run_all.sh launch
      # the tuned kernels; then the selection kernels' GPU tests
      tune_quest 400 150 4 1
      table=$OUT/$(python3 -c 'import torch; from sgl_kernel_sparse import tuning
print(tuning.config_name(torch.cuda.get_device_name()))')
      # export it only if it holds an entry: tune_quest_kernels.py writes none for a path whose tuned layer
      # was not faster than the defaults
      [ -f "$table" ] && python3 -c 'import json, sys; sys.exit(not any(k[0] != "_" for k in json.load(open(sys.argv[1]))))' \
        "$table" || table=
      if [ -n "$table" ]; then export SGL_KERNEL_SPARSE_TUNING=$table; echo "tuning table for later stages: $table"
      else echo "no tuning table for later stages: none written, or nothing in it beat the defaults"; fi
      GPU_TEST_TIMEOUT=120 gpu_tests "$stage" test/test_sparse_kernels.py -k "select_top_methods" ;;
    tune-select)  # issue 15: the selection kernels alone (bits / radix / nibble), batch 4 and 1, and the layer
      timeout $((${TUNE_LIMIT:-160} + 90)) python3 benchmark/gpu/tune_quest_kernels.py --batch 4 1 --ctx 131072 \
        --budget 2048 --stages select_top select_top_kv --time-limit "${TUNE_LIMIT:-160}" --out "$OUT/quest_tuning_select_128k.json" \
        2>&1 | tee "$OUT/$stage.txt" ;;
    tests-tuned-kernels)
      gpu_tests "$stage" test/test_sparse_kernels.py -k "launch_variants or select_top_methods or paged_decode or paged_gqa"
      gpu_tests "$stage-quest" test/test_quest_pages.py ;;
    kernels-quest128k-sweep)  # issue 15: the paged attention at 128K over block_n 32/64/128 x splits 4/8/16/32
      # (its default is not tuned for 128K; an ad hoc sweep, 2026-12-05, moved 2x between repeats: each case here
      # is the median of --iters calls with L2 flushed), then the four served kernels again
      timeout 200 python3 sgl-kernel-sparse/bench/bench_kernels.py --only quest128k --sweep --no-ref --iters 200 \
        --out "$OUT/kernels_quest128k_sweep.json" 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity)
      python3 benchmark/bench_long_context.py capacity "${LONG[@]}" --prompt-len 32768 --output-len 2048 \
        --methods dense snapkv --out long_capacity_32k.json -- --cuda-graph-bs-decode 1 2 4 8 16 32 48 64 \
        2>&1 | tee "$OUT/capacity.txt" ;;
    matched)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 32768 --batches 1 2 4 8 \
        --pool 294912 --methods plain dense quest --out long_matched_32k.json \
        -- --cuda-graph-bs-decode 1 2 4 8 2>&1 | tee "$OUT/matched.txt" ;;
    matched128k-dense)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods dense --tune dense --kv-splits 32 64 \
        --out long_matched_128k_dense.json -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-sparse)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods quest omnikv --tune \
        --out long_matched_128k_sparse.json -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-quest)  # one run: dense and Quest side by side, the same splits for both
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods dense quest --tune dense quest --kv-splits 64 \
        --out long_matched_128k_quest.json -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-quest-kv)  # issue 15: Quest with one page set per KV head (--sparse-select-per kv_head, the GQA
      # kernel) next to dense, both at 64 kv splits, one run (~9 min, est.)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods dense quest-kv --tune dense quest-kv --kv-splits 64 \
        --out long_matched_128k_quest_kv.json -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-omnikv)  # issue 15: OmniKV next to dense, both at 64 kv splits (OmniKV's five dense layers
      # too), one run; its last figures (0.95x / 1.24x / 1.44x) paid its dense layers at 8 splits (~9 min, est.)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods dense omnikv --tune dense omnikv --kv-splits 64 \
        --out long_matched_128k_omnikv.json -- --cuda-graph-bs-decode 1 2 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-omnikv-b12)  # the same at batch 1 and 2 (270,336-token pool: fits an H100 next to the 8B weights)
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 --pool 270336 --methods dense omnikv --tune dense omnikv --kv-splits 64 \
        --out "$OUT/long_matched_128k_omnikv_b12.json" -- --cuda-graph-bs-decode 1 2 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity393k)  # issue 15's pool: SnapKV first (its 89 prompts prefill for ~5 min), then dense
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 393216 \
        --prompt-len 32768 --output-len 2048 --methods snapkv dense --tune dense --kv-splits 16 32 \
        --timeout 400 --out long_capacity_32k_393k.json \
        -- --cuda-graph-bs-decode 1 2 4 8 11 16 32 64 96 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity393k-rkv)  # issue 15's capacity at its pool with a method that also bounds its decoded rows.
      # A 256-token window (warm-up 8): every request's buffer scoring (8 of every 128 tokens) and two of
      # its decode evictions fall inside it, so R-KV's figure pays for them (a 32-token window saw neither).
      # R-KV holds at most budget + interval rows, so (393,216 - 32,768) // 2,176 + 1 = 166 requests resident
      # against dense's 11 (SnapKV compresses only the prompt: 89). 166 32K prefills at ~5-9 s each outlast one
      # call: run it through bg.sh (~20 min, est.). Dense at 16 splits, the best of capacity393k's sweep.
      python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 393216 \
        --prompt-len 32768 --output-len 2048 --methods rkv dense --tune dense --kv-splits 16 \
        --timeout 2400 --window 256 --out "$OUT/long_capacity_32k_393k_rkv.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 11 16 32 64 128 166 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity393k-rkv-h100|capacity-rkv-overlap)  # the same on an 80 GB card: 393,216 tokens (54 GiB) next to
      # the 8B weights (15.3 GiB) need --mem-fraction-static 0.92 there (0.80 fits an H200); decode graphs for each
      # one's own batch only; dense swept over 16 / 32 splits (its two best on the H200), ~15 min through bg.sh.
      # capacity-rkv-overlap: the same at a smaller pool (CAP_POOL, default 196,608: 76 R-KV prefills), one call
      if [ "$stage" = capacity-rkv-overlap ]; then
        pool=${CAP_POOL:-196608} methods=${CAP_METHODS:-rkv-overlap dense} limit=1200
        out=long_capacity_32k_${pool}_rkv_overlap.json
      else
        pool=393216 methods=${CAP_METHODS:-rkv dense} limit=2400 out=long_capacity_32k_393k_rkv_h100.json
      fi
      python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool "$pool" \
        --prompt-len 32768 --output-len 2048 --methods $methods --tune dense --kv-splits ${DENSE_SPLITS:-16 32} \
        ${RKV_SPLITS:+--kv-splits-for rkv=$RKV_SPLITS} \
        --timeout "$limit" --window 256 --graphs-own-batch --out "$OUT/$out" \
        -- --mem-fraction-static 0.92 2>&1 | tee "$OUT/$stage.txt" ;;
    tests-skipkv)
      gpu_tests "$stage" test/test_gpu_server.py -k "online and skipkv" ;;
    capacity-eviction)  # issue 16: R-KV next to SnapKV and dense at a 98,304-token pool, one run
      timeout 330 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 98304 \
        --prompt-len 32768 --output-len 2048 --methods dense rkv snapkv --tune dense --kv-splits 16 \
        --timeout 200 --out "$OUT/long_capacity_32k_eviction.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 32 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-compile-dense|matched128k-compile-quest)  # issue 15: torch.compile on both sides, 64 splits
      m=${stage##*-}
      timeout 560 python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 2 4 --pool 540672 --methods "$m" --tune "$m" --kv-splits 64 --start-timeout 420 \
        --out "$OUT/long_matched_128k_compile_$m.json" -- --cuda-graph-bs-decode 1 2 4 \
        --enable-torch-compile --torch-compile-max-bs 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-compile-quest-b1)  # issue 15: compiled Quest, batch 1 only (capturing 1/2/4 took > 420 s)
      timeout 560 python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 1 --pool 270336 --methods quest --tune quest --kv-splits 64 --start-timeout 470 \
        --out "$OUT/long_matched_128k_compile_quest_b1.json" -- --cuda-graph-bs-decode 1 \
        --enable-torch-compile --torch-compile-max-bs 1 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-compile-quest-b4)  # issue 15: compiled Quest at batch 4 alone (one capture size: ~180 s of
      # autotuning, then four 128K prefills ~45 s each); compiled dense at batch 4: matched128k-compile-dense (136.0)
      timeout 560 python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches 4 --pool 540672 --methods quest --tune quest --kv-splits 64 --start-timeout 330 \
        --out "$OUT/long_matched_128k_compile_quest_b4.json" -- --cuda-graph-bs-decode 4 \
        --enable-torch-compile --torch-compile-max-bs 4 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-compile-kv-b4|matched128k-compile-kv-b1|matched128k-compile-kv-b12)  # issue 15: compiled dense
      # and compiled Quest (one page set per KV head) in one run, capturing only the batches measured; dense
      # first, so Quest's server finds the matmul autotuning of the same shapes in inductor's on-disk cache.
      # -b12: batches 1 and 2 (270,336-token pool: fits an H100 next to the 8B weights)
      b=${stage##*-b}; [ "$b" = 12 ] && bs=(1 2) || bs=("$b")
      pool=$((135168 * (b == 4 ? 4 : 2)))  # 270,336 at batch 1 / 2, as in -quest-b1
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches "${bs[@]}" --pool "$pool" --methods dense quest-kv --tune dense quest-kv --kv-splits 64 \
        --start-timeout 480 --out "$OUT/long_matched_128k_compile_kv_b$b.json" -- --cuda-graph-bs-decode "${bs[@]}" \
        --enable-torch-compile --torch-compile-max-bs "${bs[-1]}" 2>&1 | tee "$OUT/$stage.txt" ;;
    matched128k-compile-omnikv-b4|matched128k-compile-omnikv-b12)  # issue 15: the same pair for OmniKV (its
      # eager 1.83x at batch 4, 2026-12-06, left the kit's unfused ops in both steps); not yet run: whether
      # OmniKV's decode hooks trace under torch.compile on a GPU is the first thing it shows
      b=${stage##*-b}; [ "$b" = 12 ] && bs=(1 2) || bs=("$b")
      pool=$((135168 * (b == 4 ? 4 : 2)))
      python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 131072 --output-len 64 \
        --batches "${bs[@]}" --pool "$pool" --methods dense omnikv --tune dense omnikv --kv-splits 64 \
        --start-timeout 480 --out "$OUT/long_matched_128k_compile_omnikv_b$b.json" -- --cuda-graph-bs-decode "${bs[@]}" \
        --enable-torch-compile --torch-compile-max-bs "${bs[-1]}" 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-online|capacity-online-rest)  # issue 16's table: 49,152-token pool, 8,192-token prefill chunks
      # (all five did not fit one call, 2026-12-03: -rest runs the three the first call's 560 s cut)
      if [ "$stage" = capacity-online ]; then ms=(dense h2o skipkv snapkv rkv); else ms=(snapkv skipkv rkv); fi
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 49152 \
        --prompt-len 32768 --output-len 2048 --methods "${ms[@]}" --tune dense --kv-splits 16 64 \
        --timeout 200 --out "$OUT/long_capacity_32k_${stage#capacity-}.json" \
        -- --chunked-prefill-size 8192 --cuda-graph-bs-decode 1 2 4 8 16 24 2>&1 | tee "$OUT/$stage.txt" ;;
    agent-replay-dense|agent-replay-evict)  # issue 16: 32 sessions x 4 turns, 98,304-token pool
      if [ "$stage" = agent-replay-dense ]; then vs=(dense+radix); else vs=(snapkv+chain h2o+chain rkv+chain); fi
      timeout 560 python3 benchmark/bench_agent_replay.py --gpu --model-path "$M8" --variants "${vs[@]}" \
        --kv-splits 8 16 --sessions 32 --turns 4 --system 4096 --tool-output 2048 --answer 64 --budget 2048 \
        --pool 98304 --out "$OUT/agent_replay_h200_${stage##*-}.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-kvzip)  # issue 16: KVzip (keep ratio 2,048 / 32,768) next to tuned dense and SnapKV, 98,304-token pool
      # (2026-12-03: the first run, probe scored in plain torch, printed nothing before its 565 s cut;
      # the probe is now scored by triton_kvzip, whose GPU test runs first, ~1 min; the second run,
      # 524 s: KVzip's 8 probes serialize, 173 s to the last first token, no common decode window;
      # the 500 s cap ended during SnapKV's prefills. SnapKV's batch is 17: graphs up to 17)
      GPU_TEST_TIMEOUT=80 gpu_tests kvzip-kernel test/test_kvzip_kernel.py
      timeout 500 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 98304 \
        --prompt-len 32768 --output-len 2048 --methods kvzip dense snapkv --tune dense --kv-splits 16 64 \
        --timeout 200 --out "$OUT/long_capacity_32k_kvzip.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 17 2>&1 | tee "$OUT/$stage.txt" ;;
    tests-kvzip)
      gpu_tests "$stage" test/test_gpu_server.py -k kvzip ;;
    capacity-kvzip-chain)  # issue 16: KVzip's decode figure. capacity-kvzip's requests never decoded
      # together (one 22 s probe at a time, the first left its window first); here bench_long_context
      # parks each compressed prompt as a chain (1 output token), then resumes all at once (no probe)
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 98304 \
        --prompt-len 32768 --output-len 2048 --methods kvzip-chain dense snapkv --tune dense --kv-splits 16 64 \
        --timeout 240 --out "$OUT/long_capacity_32k_kvzip_chain.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 17 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-payload-equal)  # before 7a3313b the payload servers' stores took 3/4 of the memory's
      # pool (710K tokens), not of --max-total-tokens: kv_bytes_total 104 GB against dense's 29 GB
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 196608 \
        --prompt-len 32768 --output-len 2048 --methods turboquant palu palu-0.75 dense --tune dense \
        --kv-splits 16 64 --timeout 240 --graphs-own-batch --out "$OUT/long_capacity_32k_payload_equal.json" \
        2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-online-all)  # issue 16's table in one run: capacity-online's settings, now that H2O's and
      # SkipKV's prompt chunks are scored by triton_attn_sums (plain torch took ~9 / ~18 s per 32K prompt,
      # so the five did not fit one call, 2026-12-03) and R-KV's redundancy has no [n, n] matrix. Estimate:
      # six servers at 45-60 s each (decode graphs for their own batch only), 53 prefills at ~3.5 s, five
      # 40-token windows: ~560 s, so R-KV goes last (its own table: capacity-eviction). A failing kernel
      # fails its server only (the bench goes on); the kernel's GPU test is in tests-kernels
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" \
        --pool 49152 --prompt-len 32768 --output-len 2048 --methods dense h2o skipkv snapkv rkv --tune dense \
        --kv-splits 16 64 --timeout 200 --graphs-own-batch --out "$OUT/long_capacity_32k_online_all.json" \
        -- --chunked-prefill-size 8192 2>&1 | tee "$OUT/$stage.txt" ;;
    agent-replay-more)  # issue 16: the methods the 4-turn H200 replay lacked, with dense in the same call
      # (dense first: KVzip probes each turn's context, 128 probes whose time on the GPU is unknown; the
      # JSON is rewritten after every run, so a cut run keeps dense and SkipKV)
      timeout 560 python3 benchmark/bench_agent_replay.py --gpu --model-path "$M8" \
        --variants dense+radix skipkv+chain kvzip+chain --kv-splits 16 32 --sessions 32 --turns 4 --system 4096 \
        --tool-output 2048 --answer 64 --budget 2048 --pool 98304 --out "$OUT/agent_replay_h200_more.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    agent-replay9-a|agent-replay9-b)  # issue 16: the 9-turn replay (dense ~250 s, SnapKV ~75 s per run)
      A9=(--gpu --model-path "$M8" --sessions 32 --turns 9 --system 4096 --tool-output 2048 --answer 64
          --budget 2048 --pool 98304)
      if [ "$stage" = agent-replay9-a ]; then  # dense first (compile start + ~250 s), SnapKV in what is left
        timeout 420 python3 benchmark/bench_agent_replay.py "${A9[@]}" --variants dense+radix --compile-splits 16 \
          --torch-compile-max-bs 8 --out "$OUT/agent_replay9_tuned_dense16c.json" \
          -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage-dense.txt"
        timeout $((565 - SECONDS + start)) python3 benchmark/bench_agent_replay.py "${A9[@]}" --variants snapkv+chain \
          --out "$OUT/agent_replay9_tuned_snapkv.json" -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 \
          2>&1 | tee "$OUT/$stage-snapkv.txt"
      else
        timeout 330 python3 benchmark/bench_agent_replay.py "${A9[@]}" --variants dense+radix --kv-splits 32 \
          --out "$OUT/agent_replay9_tuned_dense32.json" -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 \
          2>&1 | tee "$OUT/$stage-dense.txt"
        GPU_TEST_TIMEOUT=215 gpu_tests tests-retroinfer test/test_gpu_payload.py -k retroinfer
      fi ;;
    agent-replay8-dense|agent-replay8-evict)  # the same sessions over 8 turns (dense re-prefills each
      # evicted session's whole history: its prefill grows with the square of the turns, a chain's linearly)
      if [ "$stage" = agent-replay8-dense ]; then vs=(dense+radix); sp=(16 8); else vs=(snapkv+chain); sp=(16); fi
      timeout 565 python3 benchmark/bench_agent_replay.py --gpu --model-path "$M8" --variants "${vs[@]}" \
        --kv-splits "${sp[@]}" --sessions 32 --turns 8 --system 4096 --tool-output 2048 --answer 64 --budget 2048 \
        --pool 98304 --out "$OUT/agent_replay8_h200_${stage##*-}.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    agent-replay8)  # both 8-turn variants in one call: SnapKV + chain first (~2 min), then dense + radix
      # at 16 kv splits (the 4-turn run's best: 54.8 s vs 56.5 s at 8; prefill dominates at 8 turns)
      for v in snapkv+chain dense+radix; do
        timeout $([ $v = dense+radix ] && echo 390 || echo 200) python3 benchmark/bench_agent_replay.py --gpu \
          --model-path "$M8" --variants $v --kv-splits 16 --sessions 32 --turns 8 --system 4096 \
          --tool-output 2048 --answer 64 --budget 2048 --pool 98304 --out "$OUT/agent_replay8_h200_${v%%+*}.json" \
          -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/agent-replay8-${v%%+*}.txt"
      done ;;
    overhead-compile)  # issue 15: dense through sglang_sparse vs plain SGLang, both compiled and at 16 splits
      # (2026-12-05, H100: with capture sizes 1 2 4 8 and a cold inductor cache plain's start outran 300 s at
      # 82 s a size, and dense, second, came up in 174 s on the warm cache: only the sizes measured, 420 s)
      timeout 700 python3 benchmark/bench_long_context.py matched "${LONG[@]}" --prompt-len 32768 --output-len 64 \
        --batches 1 8 --pool 294912 --methods plain dense --tune plain dense --kv-splits 16 --start-timeout 420 \
        --out "$OUT/long_matched_32k_overhead_compile.json" -- --cuda-graph-bs-decode 1 8 \
        --enable-torch-compile --torch-compile-max-bs 8 2>&1 | tee "$OUT/$stage.txt" ;;
    overhead-alt|overhead-alt-rev)  # issue 15's < 3% with repetitions. Two servers on one GPU: SGLang sizes a pool from the
      # free memory it finds minus (1 - fraction) of the card, so both ask 0.80 and the token cap (81,920 x
      # 144 KiB = 11.3 GiB + 16.4 GB of weights each) bounds what each takes; two fit an H100
      # -rev: sglang_sparse's server starts first and is measured first (4 reps)
      if [ "$stage" = overhead-alt ]; then first=(--first sglang --reps 6); else first=(--first sglang_sparse --reps 4); fi
      timeout 560 python3 benchmark/bench_overhead.py --model-path "$M8" "${first[@]}" --prompt-len 8192 \
        --new-tokens 256 --concurrency 1 8 --max-total-tokens 81920 --out "$OUT/${stage//-/_}_8k.json" -- \
        --load-format dummy --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.80 \
        --cuda-graph-backend-prefill disabled --page-size 16 --triton-attention-num-kv-splits 16 \
        --cuda-graph-bs-decode 1 8 --enable-torch-compile --torch-compile-max-bs 8 2>&1 | tee "$OUT/$stage.txt" ;;
    profile-overhead)  # overhead-alt's batch-1 gap (7.7% on an H100, 2026-12-06), kernel by kernel
      timeout 560 python3 benchmark/profile_decode.py --model-path "$M8" --prompt-len 8192 --steps 40 \
        --max-total-tokens 32768 --out "$OUT/profile_overhead_8k_b1.json" -- --load-format dummy \
        --attention-backend triton --sampling-backend pytorch --mem-fraction-static 0.80 \
        --cuda-graph-backend-prefill disabled --page-size 16 --triton-attention-num-kv-splits 16 \
        --cuda-graph-bs-decode 1 --enable-torch-compile --torch-compile-max-bs 1 2>&1 | tee "$OUT/$stage.txt" ;;
    profile-omnikv-b1|profile-omnikv-b4)  # issue 15: where OmniKV's compiled decode step goes at 128K
      # next to dense's (same flags, 64 splits), kernel by kernel; OmniKV first. -b1 fits an H100
      # (~6 min, est.); -b4 needs the H200's pool and four 128K prefills per server (~11 min, est.:
      # through bg.sh)
      b=${stage##*-b}
      timeout 1100 python3 benchmark/profile_decode.py --model-path "$M8" --variants omnikv dense --batch "$b" \
        --prompt-len 131072 --steps 20 --warmup-tokens 100 --max-total-tokens $((135168 * b + 8192)) \
        --start-timeout 480 --variant-flags omnikv="--sparse-method omnikv --sparse-token-budget 2048" \
        --out "$OUT/profile_omnikv_128k_b$b.json" -- --load-format dummy --attention-backend triton \
        --sampling-backend pytorch --mem-fraction-static 0.80 --cuda-graph-backend-prefill disabled \
        --page-size 16 --triton-attention-num-kv-splits 64 --cuda-graph-bs-decode "$b" \
        --enable-torch-compile --torch-compile-max-bs "$b" 2>&1 | tee "$OUT/$stage.txt" ;;
    overhead-compile-b8)  # the batch-8 pair again in the other order and with a 4x longer window
      timeout 390 python3 benchmark/bench_long_context.py matched --model-path "$M8" --prompt-len 32768 \
        --output-len 192 --window 128 --batches 8 --pool 294912 --methods dense plain --tune plain dense \
        --kv-splits 16 --start-timeout 200 --out "$OUT/long_matched_32k_overhead_compile_b8_rerun.json" \
        -- --cuda-graph-bs-decode 8 --enable-torch-compile --torch-compile-max-bs 8 2>&1 | tee "$OUT/$stage.txt" ;;
    prefill-flash)  # issue 17: FlashPrefill vs dense prefill, one server each, 2 requests per length
      # (the first discarded). Estimate per server: start + decode graph at batch 1 ~60 s, 32K ~8 s x 2,
      # 128K ~45 s x 2 for dense (matched128k's TTFT at 8K chunks) -> ~170 s; FlashPrefill first (its
      # served path has not run on a GPU: its mask is torch per request and layer, it may be slower)
      # ~170-230 s; both ~400 s < 560. One line per request as it goes ("prefill <variant> L=.. rep=..
      # {json}"), so a cut run still says what it measured; the JSON is rewritten after each. Dummy
      # weights: block scores near uniform, so the 0.9 mass may keep most blocks (see kept_fraction).
      timeout 560 python3 benchmark/bench_prefill.py --model-path "$M8" --prompt-len 32768 131072 \
        --variants flashprefill dense --repeats 2 --chunk 16384 --timeout 240 --start-timeout 240 \
        --out "$OUT/prefill_flash_h200.json" -- --cuda-graph-bs-decode 1 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-turboquant)  # issue 17: TurboQuant 3-bit next to tuned dense (16 / 64 splits), 196,608-token pool
      # (the prompt is held in full-precision slots until its last chunk: 1/4 of this pool = 49,152 > 32K)
      timeout 560 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 196608 \
        --prompt-len 32768 --output-len 2048 --methods turboquant dense --tune dense --kv-splits 16 64 \
        --timeout 240 --out "$OUT/long_capacity_32k_turboquant.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-turboquant-rerun)  # after a kernel change: its GPU tests, then TurboQuant and dense at
      # 16 splits (the best of 16 / 64 in capacity-turboquant: 278.4 / 269.9) at the same pool
      GPU_TEST_TIMEOUT=100 gpu_tests turboquant-kernel test/test_turboquant_kernel.py
      timeout 420 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 196608 \
        --prompt-len 32768 --output-len 2048 --methods turboquant dense --tune dense --kv-splits 16 \
        --timeout 240 --out "$OUT/long_capacity_32k_turboquant_rerun.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-palu)  # issue 17: Palu's GPU tests (kernel, Qwen3 k_norm), then Palu at ratio 0.5 next to
      # tuned dense (16 / 64 splits) at the TurboQuant stage's pool and shapes
      GPU_TEST_TIMEOUT=90 gpu_tests palu-kernel test/test_palu_kernel.py
      timeout 60 python3 sgl-kernel-sparse/bench/bench_kernels.py --only palu --out "$OUT/kernels_palu.json" \
        --no-ref 2>&1 | tee "$OUT/kernels_palu.txt"
      timeout 400 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 196608 \
        --prompt-len 32768 --output-len 2048 --methods palu dense --tune dense --kv-splits 16 64 \
        --timeout 240 --out "$OUT/long_capacity_32k_palu.json" \
        -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    capacity-palu75)  # Palu at ratio 0.75 (rank 32 of 128) at the same pool (dense: capacity-palu), after
      # the Palu kernel's sweep (block_n, warps, splits, dot16) at the capacity shapes
      timeout 90 python3 sgl-kernel-sparse/bench/bench_kernels.py --only palu --sweep --out "$OUT/kernels_palu_sweep.json" \
        --no-ref 2>&1 | tee "$OUT/kernels_palu_sweep.txt"
      timeout 300 python3 benchmark/bench_long_context.py capacity --model-path "$M8" --pool 196608 \
        --prompt-len 32768 --output-len 2048 --methods palu-0.75 --timeout 240 \
        --out "$OUT/long_capacity_32k_palu75.json" -- --cuda-graph-bs-decode 1 2 4 8 16 24 32 2>&1 | tee "$OUT/$stage.txt" ;;
    kernels-quant)  # the KIVI and TurboQuant decode kernels alone (bandwidth at the capacity shapes)
      timeout 150 python3 sgl-kernel-sparse/bench/bench_kernels.py --only kivi turboquant \
        --out "$OUT/kernels_quant.json" --no-ref 2>&1 | tee "$OUT/$stage.txt" ;;
    prefill-flash-keepall)  # issue 17: FlashPrefill at threshold 1.0 (every causal block, the same
      # kernel) next to dense in one run: separates the kernel's speed from sparsity's (0.9: prefill-flash)
      timeout 450 python3 benchmark/bench_prefill.py --model-path "$M8" --prompt-len 32768 131072 \
        --variants flashprefill@1.0 dense --repeats 2 --chunk 16384 --timeout 240 \
        --start-timeout 240 --out "$OUT/prefill_flash_keepall_h200.json" -- --cuda-graph-bs-decode 1 \
        2>&1 | tee "$OUT/$stage.txt" ;;
    save-cache)
      bash benchmark/gpu/compile_cache.sh save "$OUT" ;;
    *) echo "unknown stage $stage" ;;
  esac
  echo "=== $stage took $((SECONDS - start)) s"
  cp benchmark/results/long_*.json "$OUT/" 2>/dev/null || true
done
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
