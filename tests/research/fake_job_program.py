"""A stand-in program for launcher tests: ``python -m fake_job_program --out DIR --name NAME [--fail] [--resume]
[--stop-after S] [--stop-once]``. Appends its arguments to DIR/NAME.calls; with --stop-once and --stop-after, the
first call exits 3 (stopped cleanly); --fail exits 1; otherwise writes DIR/NAME.done and exits 0."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--fail", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--stop-after", type=float, default=None)
    ap.add_argument("--stop-once", action="store_true")
    a = ap.parse_args()
    calls = a.out / f"{a.name}.calls"
    with open(calls, "a") as f:
        f.write(" ".join(sys.argv[1:]) + "\n")
    print(f"fake {a.name}: call {len(calls.read_text().splitlines())}", flush=True)
    if a.fail:
        return 1
    if a.stop_once and a.stop_after is not None and len(calls.read_text().splitlines()) == 1:
        return 3
    (a.out / f"{a.name}.done").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
