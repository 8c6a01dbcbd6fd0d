"""What a job's lease of the GPU machine carries, and in which commands (``python -m research.stage carry JOB
[--plan]``): every command gets the working tree (whole 4 KiB blocks toward its 64 MiB) and the git-ignored paths
the job needs in every call (wheels, data/gz, scores); the staged parts (GGUF, corpus, compile cache) go once per
machine, grouped into as few staging commands as fit beside the tree; ``lease_plan`` lists the lease's commands
in order."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from research.stage_caches import COMPILE_RE, CORPUS_RE, PART_RE, StageError, parts_in
from research.stage_prepare import download_command

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # bytes per command: the working tree and the carried paths together
PART_MB = 26  # MiB: the largest part (27.3 MB); `split` makes them smaller where the tree leaves less room
WHEELS = {"fla": "fla_core", "gguf": "gguf", "plotly": "plotly"}  # need -> the wheel's distribution name
# the kinds that read a carried compile cache: it holds the training runs' compiled graphs (and the kernels they
# built); a benchmark compiles other graphs, so carrying it there would cost staging commands for nothing
TRAINING_KINDS = ("train_hybrid", "studies", "hybrid_throughput", "trainer_throughput", "reference_train")

BLOCK = 4096  # bytes: a file counts as whole blocks toward a command's 64 MiB, as on disk


def _blocks(n: int) -> int:
    """``n`` bytes as the whole 4 KiB blocks they take on disk. The machine's limit counts what a file takes, not its
    length: a 44.5 MB tree of 889 files takes 46.4 MB, and a part cut to the byte-count room was refused."""
    return -(-n // BLOCK) * BLOCK


def _size(path: Path) -> int:
    if path.is_dir():
        return sum(_blocks(p.stat().st_size) for p in path.rglob("*") if p.is_file())
    return _blocks(path.stat().st_size) if path.exists() else 0


def tree_bytes() -> int:
    """What travels without carry: tracked and untracked-but-not-ignored files, in whole 4 KiB blocks."""
    p = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                       capture_output=True)
    if p.returncode != 0:
        return 0
    return sum(_size(REPO / f) for f in p.stdout.decode().split("\0") if f and (REPO / f).is_file())


def default_part_mb(tree: int | None = None) -> int:
    """MiB per part: the room a command leaves beside the working tree (``tree`` bytes; default: this checkout's),
    less 1 MiB, at most ``PART_MB``: a part then travels in a command of its own."""
    tree = tree_bytes() if tree is None else tree
    room = (CARRY_LIMIT - tree) // 2**20 - 1
    if room < 1:
        raise StageError(f"the working tree is {tree / 1e6:.1f} MB, which leaves no room for a part in a command's "
                         f"{CARRY_LIMIT / 1e6:.1f} MB: make the tree smaller (git-ignore large untracked files)")
    return int(min(PART_MB, room))


def _wheel(dist: str) -> str:
    found = sorted((REPO / ".whl").rglob(f"{dist}-*.whl")) if (REPO / ".whl").is_dir() else []
    return str(found[-1].relative_to(REPO)) if found else f".whl/{dist}-*.whl"


def _ignored(path: str) -> bool:
    """Whether git ignores ``path`` (relative to the checkout): it travels only when carried."""
    return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0


def _arg_values(args: list[str], flag: str) -> list[str]:
    """The values of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``)."""
    out = []
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            out.append(args[i + 1])
        elif a.startswith(flag + "="):
            out.append(a.split("=", 1)[1])
    return out


def carry(job_name: str, jobs_file: str | None = None) -> dict:
    """The ignored paths ``job_name`` needs on the remote machine: ``every_call`` (paste into the command's carry),
    ``stage_once`` (GGUF parts, corpus parts and, for the training kinds, the compile cache's parts when .stage/ has
    them, one or more per call until `setup` has joined them), the sizes and what is missing
    here, with the command that makes it. A ``--scores PATH`` in the job's args that exists here and is git-ignored
    (the teacher's head scores, small) is carried in every command, so the job reads it instead of computing it."""
    from research.launch import KINDS, get_job

    job = get_job(job_name, jobs_file)
    needs = KINDS[job.kind].needs(job)
    every, once, missing = [], [], {}
    for need in sorted(needs):
        if need in ("fla", "plotly"):
            every.append(_wheel(WHEELS[need]))
        elif need == "corpus":
            every.append("data/gz")
            if not (REPO / "data" / "gz").is_dir():
                missing["data/gz"] = "python -m research.prepare_corpus"
        elif need == "broad_corpus":
            parts = parts_in(REPO / ".stage", "corpus.tar.xz", CORPUS_RE)
            once += [str(p.relative_to(REPO)) for p in parts]
            if not parts:
                missing[".stage/corpus.tar.xz.part*"] = "python -m research.stage split-corpus"
        elif need.startswith("gguf:"):
            model = need.split(":", 1)[1]
            every.append(_wheel(WHEELS["gguf"]))
            parts = parts_in(REPO / ".stage", f"{model}.gguf", PART_RE)
            once += [str(p.relative_to(REPO)) for p in parts]
            if not parts:
                missing[f".stage/{model}.gguf.part*"] = f"python -m research.stage split --model {model}"
    if job.kind in TRAINING_KINDS:  # a compile cache brought back by `compile-cache save`: training graphs
        once += [str(p.relative_to(REPO)) for p in parts_in(REPO / ".stage", "compile_cache.tgz", COMPILE_RE)]
    for path in _arg_values([str(a) for a in job.args], "--scores"):
        rel = Path(path)
        if rel.is_absolute():
            try:
                rel = rel.resolve().relative_to(REPO)
            except ValueError:
                continue  # outside the checkout: it cannot travel
        if (REPO / rel).is_file() and _ignored(str(rel)):
            every.append(str(rel))
    for path in every:
        if "*" in path:
            dist = Path(path).name.split("-")[0]
            missing[path] = " ".join(download_command([dist.replace("_", "-")], ".whl"))
    every = sorted(set(every))
    tree = tree_bytes()
    sizes = {p: _size(REPO / p) for p in every + once}
    per_call = tree + sum(sizes[p] for p in every)
    return {"job": job.name, "every_call": every, "stage_once": once, "bytes": sizes, "tree_bytes": tree,
            "per_call_bytes": per_call, "limit_bytes": CARRY_LIMIT, "missing": missing,
            "part_room_bytes": CARRY_LIMIT - per_call,
            "stage_commands": stage_commands(once, sizes, CARRY_LIMIT - tree - 2**20)}


def stage_commands(parts: list[str], sizes: dict[str, int], room: int) -> list[list[str]]:
    """The parts grouped into as few staging commands as fit ``room`` bytes each beside the tree (first fit,
    largest first; a part larger than ``room`` alone in its command, which ``carry`` flags). Each group in the
    parts' own order."""
    groups: list[list[str]] = []
    free: list[int] = []
    for p in sorted(parts, key=lambda q: -sizes[q]):
        for i, f in enumerate(free):
            if sizes[p] <= f:
                groups[i].append(p)
                free[i] -= sizes[p]
                break
        else:
            groups.append([p])
            free.append(room - sizes[p])
    order = {p: i for i, p in enumerate(parts)}
    return sorted((sorted(g, key=order.get) for g in groups), key=lambda g: order[g[0]])


STAGE_COMMAND = "python3 -m research.stage setup 2>&1 | tail -1"


def lease_plan(c: dict, seconds: int = 530) -> list[dict]:
    """The device commands of one lease for ``carry``'s job ``c``, in order: the staging commands (each a group of
    ``c["stage_commands"]``), then the job's command, to call again at once until it exits 0: ``detached.sh`` runs
    the job on between commands, and the results folder is packed into ``$OUT`` after each (its weights stay),
    beside what ``harvest`` sends for the next machines (the teacher's text, the compile cache: kept when the lease
    ends before the job does; here ``stow`` puts every command's files in place); last, where time is left, one
    command that brings back the teacher cache."""
    job = c["job"]
    run = (f"python3 -m research.stage setup >/dev/null 2>&1; . /tmp/stage/env.sh && "
           f"bash research/train_hybrid/detached.sh {job} {seconds}; rc=$?; "
           f"python3 -m research.stage pack /tmp/runs/{job} \"$OUT\" 2>&1 | tail -1; "
           f"python3 -m research.stage harvest {job} \"$OUT\" 2>&1 | tail -3; exit $rc")
    plan = [{"command": STAGE_COMMAND, "carry": group, "timeout_s": 120} for group in c.get("stage_commands", [])]
    # the teacher's side of the suites (complete once they ran), then whatever harvest has not sent yet
    caches = (f". /tmp/stage/env.sh; python3 -m research.stage teacher-cache save \"$OUT/teacher_cache_{job}.tgz\"; "
              f"python3 -m research.stage harvest {job} \"$OUT\"")
    # pack and harvest after detached.sh: ~40 s where harvest sends a compile cache of ~6,000 files
    return plan + [{"command": run, "carry": c["every_call"], "timeout_s": min(600, seconds + 65),
                    "again": "until it exits 0 (3: the job still runs)",
                    "last": f"where the lease has less than {seconds + 60} s of device time left (status's "
                            "budget_left_s), the same command with detached.sh's seconds = that time - 60: a "
                            "command cut by the lease's end never reaches `pack`, and its results stay there",
                    "here": "python -m research.stage stow /work/.device/N/* (each command's files: results into "
                            "runs/, the teacher's text into the corpus's parts, compile-cache parts into .stage/)"},
                   {"command": caches, "carry": [], "timeout_s": 120,
                    "when": "after the job's exit 0, where the lease has a minute left: the teacher's side of its "
                            "suites (-> research/gpu_cache/ to commit) and what harvest has not sent yet"}]


def print_carry(c: dict) -> None:
    mb = lambda b: f"{b / 1e6:.1f} MB" if b >= 1e5 else f"{b / 1e3:.0f} kB"  # noqa: E731
    print(f"job {c['job']}: carry in every command")
    print(json.dumps(c["every_call"]))
    for p in c["every_call"]:
        print(f"  {p:50} {mb(c['bytes'][p])}")
    print(f"  tree {mb(c['tree_bytes'])} + carry = {mb(c['per_call_bytes'])} of {mb(c['limit_bytes'])} per command")
    if c["stage_once"]:
        print("stage once per machine, each part carried by a command that runs `python3 -m research.stage setup`:")
        for p in c["stage_once"]:
            if c["bytes"][p] <= c["part_room_bytes"]:
                fits = "fits beside the carry above"
            elif c["bytes"][p] <= c["limit_bytes"] - c["tree_bytes"]:
                fits = "in a command of its own"
            else:
                fits = (f"too large even alone beside the {mb(c['tree_bytes'])} tree: split again, "
                        f"--part-mb {default_part_mb(c['tree_bytes'])}")
            print(f"  {p:50} {mb(c['bytes'][p])}  ({fits})")
    if c.get("stage_commands"):
        print(f"as {len(c['stage_commands'])} staging commands, back to back (carry, one line each):")
        for group in c["stage_commands"]:
            print(f"  {json.dumps(group)}")
    for path, fix in c["missing"].items():
        print(f"missing here: {path}: {fix}")
