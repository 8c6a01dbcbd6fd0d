"""One launcher for every research job, on whatever machine it runs: a CUDA GPU, the CPU, or under torchrun.

    python -m research.launch --list                        # the jobs of research/jobs.toml
    python -m research.launch tiny_hybrid                   # run one into runs/<YYYY-MM-DD>_tiny_hybrid/
    python -m research.launch smollm2_hybrid --dry-run      # its configs, steps and commands; nothing runs
    python -m research.launch smollm2_hybrid --stop-after 420      # stop at the next checkpoint past 420 s: exit 3
    python -m research.launch smollm2_hybrid --resume              # continue the newest runs/*_smollm2_hybrid
    torchrun --nproc_per_node 2 -m research.launch JOB      # every rank runs the job's programs; rank 0 writes

A job (research/jobs.toml, ``research.launch.jobs.Job``) names its kind (``research.launch.kinds.KINDS``), its
config files, its program's arguments and the device it expects. The launcher copies the configs into the results
folder, records the environment, runs the kind's steps (skipping those a resumed job finished) and writes every
log and result there (``research.launch.launcher``). docs/research.md is the user's guide.
"""
from research.launch.jobs import DEVICES, JOBS_FILE, Job, JobError, get_job, load_jobs
from research.launch.kinds import CONTINUE, KINDS, Context, JobKind, Step

__all__ = ["Job", "JobError", "DEVICES", "JOBS_FILE", "load_jobs", "get_job", "KINDS", "JobKind", "Step", "Context",
           "CONTINUE"]
