"""Several hybrids trained and evaluated side by side on one device, resumable: the studies of docs/results.md (the
runner; the configuration is ``research.studies.config``, whose names are re-exported here).

    cfg = StudyConfig.from_file("research/studies/reference.toml", dry_run=False, steps_scale=1.0)
    collected = run_study(cfg, out="runs/studies", deadline_s=480)     # -> OUT/studies.json

A study is a teacher, the teacher's selection scores (computed once, ``OUT/scores.json``), one three-stage
training budget shared by every variant (``[train]``: ``hybrid.train.TrainConfig`` fields; ``steps_scale``
scales every stage's steps alike, so the comparison stays fair), an evaluation plan (``[eval]``: the
``headscope.evaluate`` evaluations with their configs) and the variants (``[[variants]]``:
``research.studies.variants.VariantSpec``). Each variant x seed runs in a process of its own
(``python -m research.studies.worker``), all at once or ``parallel`` at a time: it trains (resuming from its
newest checkpoint), reloads the saved hybrid, and evaluates it item by item (one JSON per item, so a kill loses
at most the item in flight); a study with ``suite`` (e.g. "fidelity") then runs those ``headscope.evaluate``
suites on each trained variant against the teacher, one saved evaluation at a time. Variants whose ``result.json``
exists are skipped, so the same command run again continues a killed study. Folder layout::

    OUT/study.json  scores.json  calls.json  studies.json  variants/NAME/seedS/{variant.json, mask.json,
        train.json, run/ (hybrid.train: checkpoints, log.jsonl, hybrid/), train_done.json, eval/ITEM.json,
        [SUITE_parts/EVALUATION/, SUITE/, suites.json], progress.json, worker.log, result.json | infeasible.json}
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from research.studies.config import EVALUATIONS_USED, SUITES_FILE, StudyConfig, StudyError, eval_items, variant_dir
from research.studies.variants import VariantSpec

__all__ = ["StudyConfig", "StudyError", "run_study", "collect", "variant_dir", "eval_items", "EVALUATIONS_USED",
           "build_context", "suite_rows"]

SCHEMA = "research.studies.runner"
STOP_WAIT_S = 30.0  # seconds a stopped worker gets to checkpoint its step (~1.7 GB for SmolLM2), or to finish and save
#                     the evaluation part in hand, before SIGKILL


# ---- preparing a variant (main process) -------------------------------------------------------------------

def build_context(cfg: StudyConfig, tokenizer, device, folder: Path | None):
    """What a variant that trains to build its mask (kind "learned") needs: the study's tokenizer and training
    mixture (the first stage's data), the device, the variant's folder (its cache) and the ``[selector]`` table."""
    from research.studies.variants import BuildContext

    tc = cfg.train_config("selector", "mask.json", {}, 0)
    return BuildContext(tokenizer=tokenizer, data=tc.data_for(tc.stages[0]), device=device, folder=folder,
                        selector=dict(cfg.selector))


def _prepare(cfg: StudyConfig, out: Path, spec: VariantSpec, seed: int, teacher, scores,
             restart_changed: bool = False, tokenizer=None, device=None) -> bool:
    """Write the variant's folder (variant.json, mask.json, train.json); False when it is infeasible. A variant
    whose kind trains to build its mask (``spec.needs_data``) trains here, on ``device``, with ``tokenizer``."""
    from headscope.io import write_text
    from hybrid.train.checkpoint import latest_checkpoint
    from research.studies.variants import VARIANT_KINDS, InfeasibleVariant, build_variant

    d = variant_dir(out, spec.name, seed)
    d.mkdir(parents=True, exist_ok=True)
    context = build_context(cfg, tokenizer, device, d) if spec.needs_data else None
    try:
        built = build_variant(spec, teacher, scores=scores, seed=seed, base_options=cfg.hybrid,
                              train_length=cfg.train_length, context=context)
    except InfeasibleVariant as err:
        write_text(d / "infeasible.json", json.dumps({"variant": spec.to_dict(), "seed": seed, "status": "infeasible",
                                                      "reason": str(err)}, indent=1))
        print(f"[studies] {spec.name} seed {seed}: infeasible: {err}", flush=True)
        return False
    record = {"variant": spec.to_dict(), "seed": seed, "info": built.info, "options": built.options}
    write_text(d / "variant.json", json.dumps(record, indent=1, default=str))
    if built.mask is None:
        return True
    write_text(d / "mask.json", built.mask.to_json())
    tc = cfg.train_config(str(d / "run"), str(d / "mask.json"), built.options, seed)
    if not VARIANT_KINDS.entry(spec.kind).new_parameters:  # e.g. the tuned teacher: no stage of new parameters only
        from hybrid.train.stages import STAGES

        tc = tc.replace(stages=tuple(s for s in tc.stages if STAGES[s.name].trains != "new"))
    new = json.dumps(tc.to_dict(), indent=1, sort_keys=True)
    old_file = d / "train.json"
    if old_file.exists() and latest_checkpoint(d / "run") is not None:
        from hybrid.train.config import TrainConfig

        old = TrainConfig.from_file(old_file)
        if old.fingerprint() != tc.fingerprint() and restart_changed:
            import shutil

            print(f"[studies] {spec.name} seed {seed}: the training config changed; its training restarts from the "
                  "teacher (--restart-changed)", flush=True)
            shutil.rmtree(d / "run")
            for f in ("train_done.json", "progress.json"):
                (d / f).unlink(missing_ok=True)
            shutil.rmtree(d / "eval", ignore_errors=True)
        elif old.fingerprint() != tc.fingerprint():
            olds = [s.steps for s in old.stages]
            raise StudyError(f"{d}: trained with another config (stage steps {olds}, now "
                             f"{[s.steps for s in tc.stages]}); rerun with the same --steps-scale (the study was "
                             f"run with {cfg_steps_scale(out)}) and settings, pass --restart-changed to train the "
                             "changed variants again from the start, or use another --out")
    write_text(old_file, new)
    return True


def _release_cuda() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (no-op without CUDA)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def warm_kernels(teacher, tokenizer, options: dict, seq_len: int = 128) -> None:
    """One forward + backward (bf16 autocast on CUDA) and one NIAH prompt (prefill + greedy decode) of a hybrid
    whose layer l keeps l % H FA heads, so every GDN head count appears: fla's Triton kernels compile and autotune
    once, in this process, and write their choices to the Triton cache (fla caches autotuning results) before the
    workers start; without it every worker process tunes the same kernels at once."""
    import torch

    import headscope.evaluate as hev
    from headscope.mask import HeadMask, model_shape
    from hybrid.convert import from_mask

    s = model_shape(teacher)
    L, H = s["num_hidden_layers"], s["num_attention_heads"]
    heads = [(l, h) for l in range(L) for h in range(l % H)]
    if not heads:
        heads = [(0, 0)]
    device = next(teacher.parameters()).device
    model = from_mask(teacher, HeadMask.for_model(teacher, heads), **{**options, "allow_degenerate": True}).train()
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu",
                                                                                                   enabled=False)
    x = torch.randint(0, teacher.config.vocab_size, (1, seq_len), device=device)  # [1, T]
    with ac:
        logits = model(input_ids=x).logits  # [1, T, V]
    logits.float().logsumexp(-1).mean().backward()
    model.eval()
    with ac:
        hev.evaluate(model, ["niah"], tokenizer=tokenizer, configs={"niah": {"lengths": (max(64, seq_len),),
                                                                              "depths": (0.5,), "n": 1}},
                     progress=False, workers=0)
    del model


def cfg_steps_scale(out: Path) -> Any:
    try:
        return json.loads((Path(out) / "study.json").read_text()).get("steps_scale")
    except (OSError, json.JSONDecodeError):
        return "?"


def _finished(out: Path, name: str, seed: int) -> bool:
    d = variant_dir(out, name, seed)
    return (d / "result.json").exists() or (d / "infeasible.json").exists()


# ---- the scheduler ------------------------------------------------------------------------------------------

@dataclass
class _Job:
    spec: VariantSpec
    seed: int
    proc: subprocess.Popen | None = None
    log: Any = None
    started: float = 0.0
    reported: set = field(default_factory=set)
    status: str = "queued"

    @property
    def key(self) -> str:
        return f"{self.spec.name}/seed{self.seed}"


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _worker_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _launch(job: _Job, out: Path) -> None:
    d = variant_dir(out, job.spec.name, job.seed)
    job.log = open(d / "worker.log", "a", encoding="utf-8")
    cmd = [sys.executable, "-m", "research.studies.worker", "--run", str(out), "--variant", job.spec.name,
           "--seed", str(job.seed)]
    job.proc = subprocess.Popen(cmd, stdout=job.log, stderr=subprocess.STDOUT, env=_worker_env(),
                                preexec_fn=os.setsid)
    job.started, job.status = time.time(), "running"
    print(f"[studies] started {job.key} (pid {job.proc.pid})", flush=True)


def _stop(job: _Job, why: str) -> None:
    """SIGTERM to the worker itself, STOP_WAIT_S seconds for it to checkpoint the step under way
    (``worker._StopOnTerm``), then SIGKILL to its whole process group (``os.setsid``: its DataLoader workers, prompt
    builders). The SIGTERM goes to the worker alone: sent to the group, it also ended the DataLoader workers, and
    the worker's checkpoint then failed on their death ("DataLoader worker ... is killed by signal: Terminated"),
    losing every step since the last periodic checkpoint."""
    if job.proc is None or job.proc.poll() is not None:
        return
    try:
        job.proc.send_signal(signal.SIGTERM)
        job.proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(job.proc.pid, signal.SIGKILL)  # the worker if it is still there, and whatever it left behind
    except (ProcessLookupError, PermissionError):
        pass
    job.proc.wait()
    job.status = why
    print(f"[studies] stopped {job.key}: {why}", flush=True)


def _report(job: _Job, out: Path) -> str:
    """The job's progress in a few words; prints a stage's step time the first time it is known."""
    p = _read_json(variant_dir(out, job.spec.name, job.seed) / "progress.json") or {}
    phase = p.get("phase", "starting")
    if phase == "train":
        key = p.get("stage")
        if p.get("s_per_step") is not None and key not in job.reported and p.get("step", 0) >= 3:
            job.reported.add(key)
            print(f"[studies] step time {job.key} {key}: {p['s_per_step']:.3f} s/step (median, steps 2..{p['step']}"
                  f"; {p.get('steps')} steps -> ~{p['s_per_step'] * p.get('steps', 0) / 60:.1f} min)", flush=True)
        return f"{phase} {key} {p.get('step')}/{p.get('steps')} {p.get('s_per_step') or 0:.2f}s/step"
    if phase == "eval":
        return f"eval {p.get('item')} ({p.get('done', 0)}/{p.get('items', '?')})"
    if phase == "suite":
        return f"suite {p.get('suite')} ({(time.time() - float(p.get('since') or time.time())) / 60:.1f} min)"
    return phase


def _check_eval_timeout(job: _Job, out: Path, timeout_s: float) -> None:
    """Kill a worker stuck in one evaluation item past the variant's eval timeout (+ a minute's grace); the item
    is marked so a rerun skips it."""
    d = variant_dir(out, job.spec.name, job.seed)
    p = _read_json(d / "progress.json") or {}
    if p.get("phase") != "eval" or not p.get("item_since"):
        return
    if time.time() - float(p["item_since"]) > timeout_s + 60:
        from headscope.io import write_text

        skip = _read_json(d / "eval" / "_skip.json") or {}
        skip[p["item"]] = f"killed after {time.time() - float(p['item_since']):.0f} s (eval timeout {timeout_s} s)"
        write_text(d / "eval" / "_skip.json", json.dumps(skip, indent=1))
        _stop(job, f"eval item {p['item']} timed out")


def _record_call(out: Path, call: dict) -> None:
    from headscope.io import write_text

    calls = (_read_json(out / "calls.json") or {"calls": []})["calls"]
    calls = [c for c in calls if c.get("id") != call["id"]] + [call]
    write_text(out / "calls.json", json.dumps({"calls": calls}, indent=1))


def run_study(cfg: StudyConfig, *, out: str | Path | None = None, only: tuple[str, ...] = (),
              studies: tuple[int, ...] = (), parallel: int | None = None, deadline_s: float = 0.0,
              status_every: float = 30.0, command: str = "", restart_changed: bool = False) -> dict:
    """Prepare, train and evaluate every unfinished variant x seed (see the module docstring); stops the workers
    at ``deadline_s`` seconds (0: none) so that the same command continues later; ``restart_changed`` trains a
    started variant whose training config changed (e.g. another steps scale) again from the start instead of
    refusing. Returns ``collect(out)``."""
    import torch

    from headscope.io import write_text

    t0 = time.time()
    out = Path(out or cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [v for v in cfg.variants if (not only or v.name in only) and (not studies or set(v.studies) & set(studies))]
    missing = sorted(set(only) - {v.name for v in cfg.variants})
    if missing:
        raise StudyError(f"--only {missing}: not variants of this study; known: {[v.name for v in cfg.variants]}")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    call = {"id": f"{t0:.0f}", "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "seconds": 0.0,
            "device": str(device), "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "command": command, "steps_scale": cfg.steps_scale, "dry_run": cfg.dry_run, "finished": False}
    _record_call(out, call)
    todo = [(s, seed) for s in specs for seed in cfg.seeds_of(s) if not _finished(out, s.name, seed)]
    for s, seed in [(s, seed) for s in specs for seed in cfg.seeds_of(s) if _finished(out, s.name, seed)]:
        print(f"[studies] {s.name} seed {seed}: done earlier, skipped", flush=True)
    from headscope.evaluate.runtime import training_length
    from hybrid.train.build import load_teacher

    teacher, tok = load_teacher(cfg.teacher, torch.device("cpu"))  # masks and shares need its shape (CPU: cheap)
    if not cfg.train_length:
        cfg = StudyConfig.from_dict({**cfg.to_dict(), "train_length": training_length(teacher)})
    scores = None
    write_text(out / "study.json", json.dumps(cfg.to_dict(), indent=1))
    parallel = cfg.parallel if parallel is None else parallel
    stages = ", ".join(f"{s['name']} {s['steps']} x {s['batch_size']} x {s['seq_len']}" for s in cfg.train["stages"])
    tokens = sum(s["steps"] * s["batch_size"] * s["seq_len"] for s in cfg.train["stages"])
    n_train = sum(1 for s, _ in todo if s.trains)
    print(f"[studies] {len(todo)} variant run(s) to do of {sum(len(cfg.seeds_of(s)) for s in specs)} on {device}, "
          f"{parallel or 'all'} at a time; stages (steps x rows x tokens, steps scale {cfg.steps_scale:g}): {stages}; "
          f"{tokens / 1e6:.2f}M training tokens per variant, {n_train * tokens / 1e6:.1f}M for the {n_train} to train"
          + (f"; then suite(s) {', '.join(cfg.suites)} on each trained variant against the teacher" if cfg.suites
             else ""), flush=True)
    jobs: list[_Job] = []
    queue: list[_Job] = []

    def launch_ready() -> None:
        while queue and (parallel <= 0 or sum(j.status == "running" for j in jobs) < parallel):
            job = queue.pop(0)
            jobs.append(job)
            _launch(job, out)

    for s, seed in todo:  # the teacher's evaluation first (no GDN kernels), ...
        if not s.trains and _prepare(cfg, out, s, seed, teacher, None, restart_changed):
            queue.append(_Job(s, seed))
    launch_ready()
    hybrids = [(s, seed) for s, seed in todo if s.trains]
    if hybrids and cfg.warmup and device.type == "cuda":  # ... then fla's kernels tuned once, here, not per process
        tw = time.time()
        try:
            warm_kernels(teacher.to(device), tok, cfg.hybrid)
            print(f"[studies] kernels warmed up in {time.time() - tw:.1f} s (fla autotuning cached for the workers)",
                  flush=True)
        except Exception as err:  # noqa: BLE001 - the workers then tune for themselves; the study goes on
            print(f"[studies] kernel warm-up failed after {time.time() - tw:.1f} s ({type(err).__name__}: {err}); "
                  "the workers tune fla's kernels themselves", flush=True)
        teacher.to("cpu")
        _release_cuda()
    for s, seed in hybrids:  # ... then the variants that need no scores
        if not s.needs_scores and not s.needs_data and _prepare(cfg, out, s, seed, teacher, None, restart_changed):
            queue.append(_Job(s, seed))
    launch_ready()
    later = [(s, seed) for s, seed in todo if s.needs_scores or s.needs_data]  # while those train: scores, selectors
    if any(s.needs_scores for s, _ in later):
        from research.studies.variants import DEFAULT_SENDER_ROUNDS, selection_scores

        ts = time.time()
        sc = dict(cfg.scores)
        scores = selection_scores(teacher.to(device), tok, n_samples=sc.get("n_samples", 16),
                                  context_length=sc.get("context_length", 1024), haystack=sc.get("haystack", "heldout"),
                                  sender_rounds=sc.get("sender_rounds", DEFAULT_SENDER_ROUNDS), device=device,
                                  path=out / "scores.json", progress=False)
        teacher.to("cpu")
        _release_cuda()  # the workers share the GPU: this process keeps no cached blocks
        print(f"[studies] teacher scores ready ({time.time() - ts:.1f} s; {out / 'scores.json'})", flush=True)
    for s, seed in later:
        if s.needs_data:
            print(f"[studies] {s.name} seed {seed}: training its selector on {device}", flush=True)
        if _prepare(cfg, out, s, seed, teacher, scores if s.needs_scores else None, restart_changed, tok, device):
            queue.append(_Job(s, seed))
            launch_ready()
    del teacher
    timeout_s = float(cfg.eval_setting("timeout_s"))
    last_status = time.time()
    stopped = False
    while True:
        launch_ready()
        for job in jobs:
            if job.status == "running":
                if job.proc.poll() is not None:
                    job.status = "exited" if job.proc.returncode == 0 else f"failed (exit {job.proc.returncode})"
                    job.log.close()
                    print(f"[studies] {job.key} {job.status} after {(time.time() - job.started) / 60:.2f} min",
                          flush=True)
                    if job.proc.returncode != 0:
                        log = (variant_dir(out, job.spec.name, job.seed) / "worker.log").read_text(errors="replace")
                        tail = [x for x in log.splitlines() if x.strip()][-12:]
                        print("\n".join(f"[studies]   {job.key} | {x}" for x in tail), flush=True)
                else:
                    _report(job, out)
                    _check_eval_timeout(job, out, timeout_s)
        if not queue and all(j.status != "running" for j in jobs):
            break
        if deadline_s and time.time() - t0 > deadline_s:
            print(f"[studies] deadline {deadline_s:.0f} s reached: stopping; run the same command again to continue",
                  flush=True)
            for job in jobs:
                _stop(job, "deadline")
            stopped = True
            break
        if time.time() - last_status > status_every:
            last_status = time.time()
            line = "; ".join(f"{j.key}: {_report(j, out)}" for j in jobs if j.status == "running")
            print(f"[studies] {(time.time() - t0) / 60:.1f} min | {line}", flush=True)
            call["seconds"] = round(time.time() - t0, 1)
            _record_call(out, call)
        time.sleep(0.5)
    call.update(seconds=round(time.time() - t0, 1), finished=not stopped)
    _record_call(out, call)
    result = collect(out)
    write_text(out / "studies.json", json.dumps(result, indent=1, default=str))
    result["selected"] = [s.name for s in specs]  # this call's variants (--only / --studies)
    mine = [r for r in result["runs"] if r["name"] in result["selected"]]
    n_done = sum(1 for r in mine if r["status"] in ("done", "infeasible"))
    print(f"[studies] {n_done}/{len(mine)} variant runs finished; {out / 'studies.json'} "
          f"({(time.time() - t0) / 60:.2f} min this call)", flush=True)
    return result


# ---- collecting ---------------------------------------------------------------------------------------------

def suite_rows(folder: Path, suite: str) -> list[dict]:
    """The rows a variant's suite has so far: every evaluation saved to ``<suite>_parts/`` (a suite cut short
    included), else ``<suite>/results.json``."""
    parts = sorted((folder / f"{suite}_parts").glob("*/results.json"))
    files = parts or [folder / suite / "results.json"]
    return [r for f in files for r in (_read_json(f) or {}).get("rows", [])]


def collect(out: str | Path) -> dict:
    """Everything the study folder holds, as one JSON-able dict: the config, the calls (device seconds) and one
    record per variant x seed with its status, shares, training summary and headline metrics."""
    from research.studies.metrics import fidelity_headline, headline, is_long_suite, long_headline

    out = Path(out)
    cfg_data = _read_json(out / "study.json")
    if cfg_data is None:
        raise StudyError(f"{out} holds no study.json: not a study folder (run run_studies.py first)")
    cfg = StudyConfig.from_dict(cfg_data)
    runs = []
    for spec in cfg.variants:
        for seed in cfg.seeds_of(spec):
            d = variant_dir(out, spec.name, seed)
            rec: dict[str, Any] = {"name": spec.name, "seed": seed, "variant": spec.to_dict()}
            if (d / "infeasible.json").exists():
                rec.update(status="infeasible", reason=_read_json(d / "infeasible.json").get("reason"))
                runs.append(rec)
                continue
            v = _read_json(d / "variant.json")
            if v is None:
                rec["status"] = "not run yet"
                runs.append(rec)
                continue
            rec["info"] = v["info"]
            rec["train"] = _read_json(d / "train_done.json")
            items = {}
            rows = []
            for f in sorted((d / "eval").glob("*.json")) if (d / "eval").exists() else []:
                if f.name.startswith("_"):
                    continue
                item = _read_json(f) or {}
                items[item.get("item", f.stem)] = {"status": item.get("status"), "seconds": item.get("seconds")}
                rows += item.get("rows", [])
            rec["eval_items"] = items
            rec["metrics"] = headline(rows, cfg.train_length)
            if cfg.suites and spec.trains:
                rec["suites"] = _read_json(d / SUITES_FILE) or {}  # the suites finished
                rec["fidelity"] = {name: fidelity_headline(suite_rows(d, name)) for name in cfg.suites}
                rec["long"] = {name: long_headline(suite_rows(d, name)) for name in cfg.suites if is_long_suite(name)}
            res = _read_json(d / "result.json")
            if res is not None:
                rec["status"] = "done"
            elif spec.trains and rec["train"] is None:
                rec["status"] = "training unfinished"
            else:
                rec["status"] = "evaluation unfinished"
            runs.append(rec)
    calls = (_read_json(out / "calls.json") or {"calls": []})["calls"]
    return {"schema": SCHEMA, "config": cfg.to_dict(), "calls": calls, "runs": runs}
