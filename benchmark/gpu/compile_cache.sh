#!/usr/bin/env bash
# torch.compile's caches, carried from one GPU machine to the next.
#
# Each device call starts on a bare machine, so every --enable-torch-compile server compiles and
# autotunes from scratch: ~80 s per captured batch size on an H100 (2026-12-05), where a second
# server on the warm cache of the same machine came up in 174 s against > 300 s. Inductor (FX
# graphs, autotuning choices) and Triton (compiled kernels, SGLang's and ours) key their entries
# by source, torch / Triton version and GPU, so a cache from another GPU or code version is only
# dead weight, never a wrong kernel.
#
#   restore          unpack .gpucache/compile_cache.tar.xz (when carried) into $SPARSE_CACHE_DIR,
#                    once per machine (benchmark/gpu/env.sh calls this)
#   save DIR         pack $SPARSE_CACHE_DIR into DIR/compile_cache.tar.xz when it fits one file
#                    that a device call returns (15 MiB; COMPILE_CACHE_MAX_MB to change), else say
#                    how large it is and write nothing (run_all.sh's stage save-cache)
#
# Here, after a call that returned compile_cache.tar.xz: copy it to .gpucache/ (git-ignored) and
# add ".gpucache" to the next calls' carry (with .gpu and .gpumodel: 64 MiB in all).
set -uo pipefail
cd "$(dirname "$0")/../.."
base=${SPARSE_CACHE_DIR:-${TMPDIR:-/tmp}/sglang_sparse_cache}
carried=.gpucache/compile_cache.tar.xz
case ${1:-} in
  restore)
    if [ -f "$carried" ] && [ ! -e "$base/.restored" ]; then
      mkdir -p "$base" && tar -xJf "$carried" -C "$base" && touch "$base/.restored" \
        && echo "compile cache: restored $(du -sh "$base" | cut -f1) from $carried"
    fi ;;
  save)
    [ $# -ge 2 ] || { echo "usage: compile_cache.sh save DIR" >&2; exit 2; }
    [ -d "$base" ] || { echo "compile cache: nothing at $base"; exit 0; }
    mkdir -p "$2"
    tmp="$2/compile_cache.tar.xz.part"
    XZ_OPT=${XZ_OPT:--6 -T0} tar --exclude=./.restored -cJf "$tmp" -C "$base" .
    mb=$(( ($(stat -c %s "$tmp") + 1048575) / 1048576 )) max=${COMPILE_CACHE_MAX_MB:-15} size=$(du -sh "$base" | cut -f1)
    if [ "$mb" -le "$max" ]; then
      mv "$tmp" "$2/compile_cache.tar.xz"
      echo "compile cache: $size packed into $2/compile_cache.tar.xz ($mb MiB)"
    else
      rm -f "$tmp"
      echo "compile cache: $size, $mb MiB packed: over $max MiB, not saved"
    fi ;;
  *) echo "usage: compile_cache.sh restore | save DIR" >&2; exit 2 ;;
esac
