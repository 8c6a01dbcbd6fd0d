#!/usr/bin/env bash
# Keep Triton's autotuning results between GPU machines. fla's kernels autotune on first use (about 170 s per
# (head count, head dim) for the gated delta rule's forward + backward on the H200), and every device call may
# start on a bare machine. Triton (cache_results=True, which fla sets) writes each winner to
# ~/.triton/cache/<hash>/<kernel>.autotune.json, the hash covering the kernel source, Triton version, GPU target
# and tuning key; a machine with the same image finds them and compiles only the winning config.
#   bash research/triton_cache.sh save $OUT/triton_autotune.tgz   # at the end of a GPU call
#   bash research/triton_cache.sh restore                          # at the start: every research/gpu_cache/*.tgz
# The archives hold small JSON files only (no binaries); a stale one is ignored by Triton (another hash).
set -uo pipefail
CACHE="${TRITON_CACHE_DIR:-$HOME/.triton/cache}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-}" in
save)
    [ -d "$CACHE" ] || { echo "triton_cache: no $CACHE"; exit 0; }
    files=$(cd "$CACHE" && find . -name '*.autotune.json' | sed 's|^\./||')
    [ -n "$files" ] || { echo "triton_cache: no autotune results in $CACHE"; exit 0; }
    (cd "$CACHE" && tar -czf "$2" $files) && echo "triton_cache: saved $(echo "$files" | wc -l) results to $2" ;;
restore)
    mkdir -p "$CACHE"; n=0
    for a in "$ROOT"/research/gpu_cache/*.tgz; do [ -f "$a" ] && tar -xzf "$a" -C "$CACHE" && n=$((n + 1)); done
    echo "triton_cache: restored $n archive(s) into $CACHE" ;;
*) echo "usage: triton_cache.sh save FILE.tgz | restore"; exit 2 ;;
esac
