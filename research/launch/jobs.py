"""The job table: named jobs in TOML (research/jobs.toml), each one a ``Job``.

    [jobs.tiny_hybrid]
    kind = "train_hybrid"                        # an entry of research.launch.kinds.KINDS
    config = "research/train_hybrid/tiny.toml"   # a config file (or a list of them), relative to the repository root
    args = ["--tiny", "--n", "1"]                # the kind's program's own arguments
    device = "cpu"                               # what it expects: "cpu", "cuda" or "any"

A job names what it runs and nothing else: the numbers live in its config files and arguments.

    jobs = load_jobs()                           # {name: Job}, every job validated
    job = get_job("tiny_hybrid")
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

__all__ = ["Job", "JobError", "DEVICES", "JOBS_FILE", "REPO", "load_jobs", "get_job"]

REPO = Path(__file__).resolve().parents[2]
JOBS_FILE = REPO / "research" / "jobs.toml"
DEVICES = ("cpu", "cuda", "any")  # "any": runs where it is started (CUDA when there is a GPU, else the CPU)


class JobError(ValueError):
    """A job table or a job that cannot run; the message names the job, the problem and the fix."""


def _word(name: object) -> bool:
    return isinstance(name, str) and bool(name) and name.replace("_", "").replace("-", "").isalnum()


@dataclass(frozen=True)
class Job:
    """One named job. ``config`` is a tuple of paths relative to the repository root (a TOML string or list);
    ``args`` are strings (TOML numbers are accepted and written as strings)."""

    name: str
    kind: str
    config: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    device: str = "cuda"
    source: str = field(default="research/jobs.toml", compare=False)  # where it was read from (for messages)

    def __post_init__(self) -> None:
        from research.launch.kinds import KINDS

        where = f"job {self.name!r} ({self.source})"
        if not _word(self.name):
            raise JobError(f"{where}: the name must be a word (letters, digits, _ or -): rename the table "
                           "[jobs.<name>]")
        if self.kind not in KINDS:
            raise JobError(f"{where}: kind = {self.kind!r} is not one of {KINDS.names()}; use one of them, or add a "
                           "kind to research.launch.kinds.KINDS (one entry + a test)")
        config = (self.config,) if isinstance(self.config, str) else tuple(self.config)
        args = (self.args,) if isinstance(self.args, str) else tuple(self.args)
        if not all(isinstance(c, str) and c for c in config):
            raise JobError(f"{where}: config = {self.config!r} must be a path or a list of paths (strings)")
        bad = [a for a in args if not isinstance(a, (str, int, float)) or isinstance(a, bool)]
        if bad:
            raise JobError(f"{where}: args must be strings or numbers, not {bad!r} (write flags as \"--n\", \"30\")")
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "args", tuple(a if isinstance(a, str) else repr(a) for a in args))
        if self.device not in DEVICES:
            raise JobError(f"{where}: device = {self.device!r} is not one of {DEVICES}")
        kind = KINDS[self.kind]
        lo, hi = kind.configs
        if not lo <= len(config) <= hi:
            want = f"{lo}" if lo == hi else f"{lo} to {hi}"
            raise JobError(f"{where}: kind {self.kind!r} takes {want} config file(s), this job names {len(config)}: "
                           f"fix its `config`")
        for c in config:
            if not (REPO / c).is_file():
                raise JobError(f"{where}: config file {c} does not exist (paths are relative to the repository "
                               f"root {REPO}): fix the path in `config`")
        if kind.check is not None:
            problem = kind.check(self)
            if problem:
                raise JobError(f"{where}: {problem}")

    @property
    def config_paths(self) -> tuple[Path, ...]:
        return tuple(REPO / c for c in self.config)

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any], source: str = "research/jobs.toml") -> "Job":
        if not isinstance(data, dict):
            raise JobError(f"job {name!r} ({source}): [jobs.{name}] must be a table of kind, config, args, device")
        known = {f.name for f in fields(cls)} - {"name", "source"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise JobError(f"job {name!r} ({source}): unknown key(s) {unknown}; a job has only {sorted(known)} "
                           "(numbers belong in its config file or its args)")
        if "kind" not in data:
            raise JobError(f"job {name!r} ({source}): no `kind`; give one of the registered kinds "
                           "(python -m research.launch --kinds)")
        return cls(name=name, source=source, **data)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "config": list(self.config), "args": list(self.args),
                "device": self.device}


def load_jobs(path: str | Path | None = None) -> dict[str, Job]:
    """Every job of the table at ``path`` (default research/jobs.toml), validated; {name: Job} in file order."""
    p = Path(path) if path is not None else JOBS_FILE
    source = str(p.relative_to(REPO)) if p.is_absolute() and p.is_relative_to(REPO) else str(p)
    if not p.is_file():
        raise JobError(f"job table {p} does not exist; give --jobs FILE or create it ([jobs.<name>] tables)")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as err:
        raise JobError(f"job table {source} is not valid TOML: {err}") from None
    extra = sorted(set(data) - {"jobs"})
    if extra:
        raise JobError(f"job table {source}: top-level key(s) {extra}; only [jobs.<name>] tables belong here")
    tables = data.get("jobs", {})
    if not tables:
        raise JobError(f"job table {source} holds no [jobs.<name>] table")
    return {name: Job.from_dict(name, t, source) for name, t in tables.items()}


def get_job(name: str, path: str | Path | None = None) -> Job:
    jobs = load_jobs(path)
    if name not in jobs:
        close = [n for n in jobs if name in n or n in name]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise JobError(f"no job {name!r} in the job table{hint}; the jobs: {', '.join(jobs)} "
                       "(python -m research.launch --list)")
    return jobs[name]
