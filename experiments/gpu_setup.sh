# Sourced by the H200 call scripts (experiments/gpu_chain.sh, experiments/train_hybrid/gpu_h200.sh,
# experiments/studies/gpu_h200.sh) from the repository root: the set-up every call shares.
#   wheels FILE...  install carried wheels into /tmp/site (already on PYTHONPATH)
#   corpus          data/corpus/{train,heldout}.txt from the carried data/gz/*.txt.gz, if not there yet
#   stage           put every carried GGUF part into /tmp/stage (experiments/stage_gguf.sh)
# It also exports PYTHONUNBUFFERED, TRITON_CACHE_AUTOTUNING and PYTHONPATH, makes $OUT, and restores the Triton
# autotune results of earlier calls (experiments/triton_cache.sh; save them at the end with its `save`).
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
stage() { for p in .stage/*.part*; do [ -f "$p" ] && bash experiments/stage_gguf.sh put "$p"; done; }
bash experiments/triton_cache.sh restore
