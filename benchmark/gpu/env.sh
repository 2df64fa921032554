# There (the GPU machine), from the checkout root: `. benchmark/gpu/env.sh`.
# SGLang from the kit, and sglang_sparse from this checkout with its plugin entry point visible
# to every SGLang process (a dist-info on PYTHONPATH; nothing is installed).
. .gpu/env.sh
ep=${TMPDIR:-/tmp}/sglang_sparse_ep
mkdir -p "$ep/sglang_sparse-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: sglang-sparse\nVersion: 0.1.0\n' > "$ep/sglang_sparse-0.1.0.dist-info/METADATA"
printf '[sglang.srt.plugins]\nsglang_sparse = sglang_sparse.srt.plugin:load\n' \
  > "$ep/sglang_sparse-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$PWD/python:$PWD/sgl-kernel-sparse/python:$ep:$PYTHONPATH"
# torch.compile's and Triton's caches in one folder that a later machine can start from
# (benchmark/gpu/compile_cache.sh; SGLang only sets these where they are unset)
export SPARSE_CACHE_DIR=${SPARSE_CACHE_DIR:-${TMPDIR:-/tmp}/sglang_sparse_cache}
export TORCHINDUCTOR_CACHE_DIR="$SPARSE_CACHE_DIR/inductor" TRITON_CACHE_DIR="$SPARSE_CACHE_DIR/triton"
bash benchmark/gpu/compile_cache.sh restore
