# Sourced by the H200 call scripts (research/gpu_chain.sh, research/train_hybrid/gpu_h200.sh,
# research/studies/gpu_h200.sh) from the repository root: the set-up every call shares.
#   wheels FILE...  install carried wheels into /tmp/site (already on PYTHONPATH)
#   corpus          data/corpus/{train,heldout}.txt from the carried data/gz/*.txt.gz, if not there yet
#   stage           put every carried GGUF part into /tmp/stage (research/stage_gguf.sh)
#   toml_get, staged_teacher: a config's value; a registry teacher's staged GGUF (below)
# It also exports PYTHONUNBUFFERED, TRITON_CACHE_AUTOTUNING and PYTHONPATH, makes $OUT, and restores the Triton
# autotune results of earlier calls (research/triton_cache.sh; save them at the end with its `save`).
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1  # autotune results shared by processes through the cache
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD
wheels() { [ $# -eq 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$@" || exit 1; }
corpus() {
    mkdir -p data/corpus
    for f in train heldout; do [ -f data/corpus/$f.txt ] || gunzip -c data/gz/$f.txt.gz > data/corpus/$f.txt; done
}
# stamp: prefix every line (and every progress-bar update: \r ends a line too) with the seconds since it started
stamp() { python3 -u -c 'import io, sys, time
t = time.time()
for line in io.TextIOWrapper(sys.stdin.buffer, newline=None, errors="replace"): sys.stdout.write(f"{time.time() - t:7.1f} {line.rstrip()}\n")'; }
# optional: the wheels under a carried folder, if it was carried (e.g. .whl/plotly: training.html, result figures)
optional_wheels() { for d in "$@"; do ls "$d"/*.whl >/dev/null 2>&1 && wheels "$d"/*.whl; done; return 0; }
stage() { for p in .stage/*.part*; do [ -f "$p" ] && bash research/stage_gguf.sh put "$p"; done; }
# toml_get FILE KEY DEFAULT: a top-level value of a TOML file
toml_get() { python3 -c "import sys, tomllib; print(tomllib.load(open(sys.argv[1], 'rb')).get(sys.argv[2], sys.argv[3]))" "$@"; }
# staged_teacher NAME: source /tmp/stage/env.sh (a staged GGUF) when it is there; fails, saying which parts to carry,
# when NAME is a registry model (not "default", not a folder) whose GGUF is not staged on this machine
staged_teacher() {
    if [ -f /tmp/stage/env.sh ]; then . /tmp/stage/env.sh; echo "teacher $1; GGUF staged: $HEADSCOPE_CACHE"; return 0; fi
    [ "$1" = default ] || [ -d "$1" ] && return 0
    echo "teacher $1: no /tmp/stage/env.sh: its GGUF is not staged on this machine (staged: $(ls /tmp/stage 2>/dev/null | tr '\n' ' '))."
    echo "Carry the missing .stage/$1.gguf.partKofN, one per call (bash research/stage_gguf.sh put ...), then run this again."
    return 1
}
bash research/triton_cache.sh restore
