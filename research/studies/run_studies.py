"""The studies 2-5 and 7 (docs/results.md) on one device: every variant of the config trained with the same three-stage budget and
evaluated with the same prompts, side by side (one process each), resumable. Writes OUT/studies.json; the tables
come from research/studies/render_studies.py.

GPU (one H200; `python -m research.launch studies_reference` runs this as a job, docs/research.md):
    python -m research.studies.run_studies --config research/studies/reference.toml --out runs/studies \
        --deadline-s 480
CPU dry run (tiny settings, 6 variants, minutes; not a result):
    python -m research.studies.run_studies --config research/studies/reference.toml --out /tmp/st --dry-run
Studies 2-5 on the real teacher SmolLM2-135M-Instruct, 2 seeds (`python -m research.launch studies_smollm2`); its
dry run uses the real model on the CPU (~4 minutes):
    python -m research.studies.run_studies --config research/studies/smollm2.toml --out /tmp/sd --dry-run
The selection study's headline rows on SmolLM2's broad recipe, each trained row then judged by the fidelity suite
against the teacher (`suite = "fidelity"`; `python -m research.launch studies_smollm2_broad`, docs/research.md):
    python -m research.studies.run_studies --config research/studies/smollm2_broad.toml --out runs/sb [--only ROWS]

Run the same command again after a kill (or after --deadline-s stopped it): finished variants are skipped, training
resumes from each variant's newest checkpoint, and evaluation from its next item. STEPS_SCALE (or --steps-scale)
multiplies every stage's steps for all variants alike; a folder must be continued with the scale it started with.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the study TOML (research/studies/reference.toml)")
    ap.add_argument("--out", default=None, help="the study folder (default: the config's out)")
    ap.add_argument("--dry-run", action="store_true", help="the config's [dry_run] settings (CPU, tiny)")
    ap.add_argument("--profile", default=None, help="merge the config's [profiles.NAME] table (e.g. cpu)")
    ap.add_argument("--steps-scale", type=float, default=float(os.environ.get("STEPS_SCALE", "1")),
                    help="multiply every stage's steps (default: env STEPS_SCALE or 1)")
    ap.add_argument("--only", default="", help="comma-separated variant names")
    ap.add_argument("--studies", default="", help="comma-separated study numbers (2,3,4,5,7)")
    ap.add_argument("--parallel", type=int, default=None, help="variants in flight at once (0: all)")
    ap.add_argument("--deadline-s", type=float, default=float(os.environ.get("DEADLINE_S", "0")),
                    help="stop every worker after this many seconds (0: none); rerun to continue")
    ap.add_argument("--restart-changed", action="store_true",
                    help="a started variant whose training config changed (another --steps-scale) trains again from "
                         "the start, instead of being refused")
    ap.add_argument("--status-every", type=float, default=30.0, help="seconds between status lines")
    a = ap.parse_args(argv)

    from research.studies.runner import StudyConfig, StudyError, run_study

    try:
        cfg = StudyConfig.from_file(a.config, dry_run=a.dry_run, steps_scale=a.steps_scale, profile=a.profile)
        command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]) + (
            f"  [STEPS_SCALE={a.steps_scale:g}]" if a.steps_scale != 1 else "")
        result = run_study(cfg, out=a.out, only=tuple(x for x in a.only.split(",") if x),
                           studies=tuple(int(x) for x in a.studies.split(",") if x), parallel=a.parallel,
                           deadline_s=a.deadline_s, status_every=a.status_every, command=command,
                           restart_changed=a.restart_changed)
    except StudyError as err:
        print(f"run_studies: error: {err}", file=sys.stderr)
        return 2
    unfinished = [f"{r['name']}/seed{r['seed']}: {r['status']}" for r in result["runs"]
                  if r["name"] in result["selected"] and r["status"] not in ("done", "infeasible")]
    if unfinished:
        print("unfinished (run the same command again to continue): " + "; ".join(unfinished))
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
