#!/usr/bin/env bash
# Run GPU stages that together outlast one 10-minute device call.
#
# A process started in its own session (setsid) survives the call that started it while the
# machine stays warm (it is given back after ~30 s idle), so:
#   call 1:  bash benchmark/gpu/bg.sh start STAGE...   # starts run_all.sh in the background, then waits
#            (BG_SMALL_STAGES="S..." bash benchmark/gpu/bg.sh start STAGE...: S... on a card under 100 GB)
#   call 2+: bash benchmark/gpu/bg.sh wait             # waits again; every call copies the results to $OUT
# Each call returns after BG_WAIT seconds (default 570) or as soon as the stages end, and prints
# the tail of the log. The stages run from a snapshot of the checkout taken at start
# ($BG_DIR/src). Results accumulate in $BG_DIR (default /root/bg_out) and are copied to
# $OUT on every call, so each call brings back everything so far. Make the next call at once:
# the idle machine is given back within seconds, and the background run with it.
set -uo pipefail
cd "$(dirname "$0")/../.."
BG_DIR=${BG_DIR:-/root/bg_out}
OUT=${OUT:-/tmp/sglang_sparse_out}
cmd=${1:-wait}; shift || true
case $cmd in
  start)
    [ $# -gt 0 ] || { echo "usage: bg.sh start STAGE..." >&2; exit 2; }
    # BG_SMALL_STAGES: what to run instead on a card under 100 GB (an H100 that came when an H200
    # was asked for, or a call left free to take either): the 128K batch-4 stages do not fit it
    if [ -n "${BG_SMALL_STAGES:-}" ]; then
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
      if [ -n "$mib" ] && [ "$mib" -lt 100000 ]; then
        echo "a ${mib} MiB card: BG_SMALL_STAGES instead of $*"
        set -- $BG_SMALL_STAGES
      fi
    fi
    if [ -f "$BG_DIR/pid" ] && kill -0 "$(cat "$BG_DIR/pid")" 2>/dev/null; then
      echo "a background run is still going (pid $(cat "$BG_DIR/pid")): bg.sh wait" >&2; exit 1
    fi
    [ -d "$BG_DIR" ] && { rm -rf "$BG_DIR.prev"; mv "$BG_DIR" "$BG_DIR.prev"; }  # an earlier run's results
    mkdir -p "$BG_DIR/src"
    # run from a snapshot: every later device call re-sends the working tree, and a stage that starts
    # after an edit here would otherwise run the edited code (.gpu / .gpumodel / .gpucache are linked, not copied)
    tar --exclude=./.git --exclude=./.venv --exclude=./.gpu --exclude=./.gpumodel --exclude=./.gpucache -cf - . \
      | tar -xf - -C "$BG_DIR/src"
    for d in .gpu .gpumodel .gpucache; do [ -e "$d" ] && ln -s "$PWD/$d" "$BG_DIR/src/$d"; done
    # HEAD may be stale on the device machine (its .git is not re-sent with every call; the files
    # are): the tree hash of the files as they are names what ran (here: git log --format='%h %T')
    { git rev-parse HEAD 2>/dev/null || echo "no git here"
      idx=$(mktemp -u); GIT_INDEX_FILE=$idx git add -A >/dev/null 2>&1 && echo "tree $(GIT_INDEX_FILE=$idx git write-tree)"
      rm -f "$idx"; } > "$BG_DIR/commit"
    OUT="$BG_DIR" setsid nohup bash -c 'bash "$0"/benchmark/gpu/run_all.sh "$@"; echo "=== all stages ended rc=$?"' \
      "$BG_DIR/src" "$@" > "$BG_DIR/log" 2>&1 < /dev/null &
    echo $! > "$BG_DIR/pid"
    echo "started: $* (pid $(cat "$BG_DIR/pid"))" ;;
  wait) ;;
  *) echo "usage: bg.sh start STAGE... | bg.sh wait" >&2; exit 2 ;;
esac
[ -f "$BG_DIR/pid" ] || { echo "no background run here (a fresh machine?)" >&2; exit 1; }
deadline=$((SECONDS + ${BG_WAIT:-570}))
while [ $SECONDS -lt $deadline ] && kill -0 "$(cat "$BG_DIR/pid")" 2>/dev/null; do sleep 5; done
# a call brings back at most 8 files: leave the snapshot and the pid file behind
mkdir -p "$OUT"; (cd "$BG_DIR" && cp -r $(ls -A | grep -vxE 'src|pid') "$OUT"/)
if kill -0 "$(cat "$BG_DIR/pid")" 2>/dev/null; then echo "--- still running"; else echo "--- ended"; fi
grep -E '^(=== |matched|dense |quest|wrote|.*failed)' "$BG_DIR/log" | tail -40
tail -c 3000 "$BG_DIR/log"
