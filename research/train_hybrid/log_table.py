"""Training logs side by side, per stage: steps, final losses, tokens/s, memory and the first compiled step, each
run's tokens/s also as a ratio to the first run's at the same stage (same schedule place).

    python -m research.train_hybrid.log_table ce=RUN_A/train_log.jsonl long_distill=RUN_B/train_log.jsonl \
        [--out table.csv]

Each LOG is a ``hybrid.train`` log (``log.jsonl``, a results folder's ``train_log.jsonl``): the step records
(``hybrid.train.logs.read_log``) and the events beside them (``warmup_step``: the first, compiling step's seconds;
``stage_capped``: a stage ended by its ``max_minutes``). Tokens/s is the median over a stage's log records, as
``trainer_throughput.py`` reads it. A run cut off mid-stage shows that stage up to its last record.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

COLUMNS = ("run", "stage_index", "stage", "steps", "capped", "loss", "loss_kl", "loss_ce", "tok_per_s_median",
           "tok_per_s_ratio", "gpu_mem_gib", "first_step_s")


def stage_rows(name: str, path: Path) -> list[dict]:
    """One row per stage of the log at ``path`` (run label ``name``)."""
    from hybrid.train.logs import read_log

    records = [r for r in read_log(path) if "tok_per_s" in r]
    events = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()
              if line.strip() and '"event"' in line]
    rows = []
    for index in sorted({r["stage_index"] for r in records}):
        mine = [r for r in records if r["stage_index"] == index]
        last = mine[-1]
        of = [e for e in events if e.get("stage_index") == index]
        warm = [e["seconds"] for e in of if e["event"] == "warmup_step"]
        rows.append({"run": name, "stage_index": index, "stage": last["stage"], "steps": last["step"],
                     "capped": any(e["event"] == "stage_capped" for e in of), "loss": last.get("loss"),
                     "loss_kl": last.get("loss_kl"), "loss_ce": last.get("loss_ce"),
                     "tok_per_s_median": statistics.median(r["tok_per_s"] for r in mine), "tok_per_s_ratio": None,
                     "gpu_mem_gib": max((r.get("gpu_mem_gib") or 0) for r in mine) or None,
                     "first_step_s": warm[0] if warm else None})
    return rows


def table(runs: list[tuple[str, Path]]) -> list[dict]:
    """Every run's stage rows, the tokens/s ratio to the first run's at the same stage index."""
    rows = [r for name, path in runs for r in stage_rows(name, path)]
    base = {r["stage_index"]: r["tok_per_s_median"] for r in rows if r["run"] == runs[0][0]}
    for r in rows:
        if r["stage_index"] in base:
            r["tok_per_s_ratio"] = round(r["tok_per_s_median"] / base[r["stage_index"]], 3)
    return rows


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", help="NAME=LOG: a label and a hybrid.train log (log.jsonl / train_log.jsonl)")
    ap.add_argument("--out", default=None, help="also write the table as CSV here")
    a = ap.parse_args(argv)
    runs = []
    for item in a.logs:
        name, sep, path = item.partition("=")
        if not sep or not name or not Path(path).is_file():
            ap.error(f"{item!r}: give NAME=LOG with LOG an existing training log (log.jsonl or train_log.jsonl)")
        runs.append((name, Path(path)))
    rows = table(runs)
    print(" | ".join(COLUMNS))
    for r in rows:
        print(" | ".join(_fmt(r[c]) for c in COLUMNS))
    if a.out:
        import pandas as pd

        from headscope.io import write_text

        write_text(Path(a.out), pd.DataFrame(rows, columns=list(COLUMNS)).to_csv(index=False))
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
