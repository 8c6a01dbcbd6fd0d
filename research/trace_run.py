"""Run a Python script as __main__ and dump every thread's stack to stderr every N seconds: where a long GPU call's
untimed seconds go, without editing the script.

    python3 research/trace_run.py --every 30 research/train_hybrid/run.py --config ... --out ...
"""
from __future__ import annotations

import faulthandler
import runpy
import sys


def main() -> None:
    args = sys.argv[1:]
    every = 30.0
    if args[:1] == ["--every"]:
        every, args = float(args[1]), args[2:]
    if not args:
        sys.exit("usage: trace_run.py [--every SECONDS] SCRIPT [ARGS...]")
    faulthandler.dump_traceback_later(every, repeat=True, file=sys.stderr)
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
