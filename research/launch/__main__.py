"""python -m research.launch JOB [--out DIR] [--resume] [--stop-after SECONDS] [--dry-run] | --list | --kinds

Runs one job of research/jobs.toml end to end into one results folder (research/launch/__init__.py,
docs/research.md). Exit codes: 0 finished; 3 stopped cleanly, continue with --resume; 1 a step failed; 2 the job
cannot start.
"""
from __future__ import annotations

import argparse
import sys

from research.launch.jobs import JobError, get_job, load_jobs
from research.launch.kinds import CONTINUE, KINDS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m research.launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", nargs="?", help="a job of the job table (--list)")
    ap.add_argument("--out", default=None, help="the results folder (default runs/<YYYY-MM-DD>_<job>/)")
    ap.add_argument("--resume", action="store_true",
                    help="continue the job's folder (--out, else the newest runs/*_<job>): finished steps are "
                         "skipped, the programs resume from their own checkpoints; starts it if there is none")
    ap.add_argument("--stop-after", type=float, default=None, metavar="SECONDS",
                    help=f"stop at the next checkpoint past SECONDS and exit {CONTINUE} (continue with --resume): "
                         "for machines that give each command a time limit")
    ap.add_argument("--dry-run", action="store_true", help="resolve the job and print its steps; run nothing")
    ap.add_argument("--list", action="store_true", help="list the jobs")
    ap.add_argument("--kinds", action="store_true", help="list the job kinds")
    ap.add_argument("--jobs", default=None, help="another job table (default research/jobs.toml)")
    a = ap.parse_args(argv)
    try:
        if a.kinds:
            for name, kind in KINDS.items():
                print(f"{name:24} {kind.summary}")
            return 0
        if a.list:
            jobs = load_jobs(a.jobs)
            width = max(len(n) for n in jobs)
            for name, job in jobs.items():
                extra = " ".join(job.args)
                print(f"{name:{width}}  {job.kind:22} {job.device:5} {' '.join(job.config) or '-'}"
                      + (f"  {extra}" if extra else ""))
            return 0
        if not a.job:
            ap.error("give a JOB (python -m research.launch --list shows them)")
        job = get_job(a.job, a.jobs)
        from research.launch.launcher import dry_run, launch, results_folder

        if a.dry_run:
            return dry_run(job, results_folder(job, a.out, a.resume))
        return launch(job, out=a.out, resume=a.resume, stop_after=a.stop_after)
    except JobError as err:
        print(f"research.launch: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
