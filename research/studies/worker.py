"""One variant x seed of a study, in a process of its own (started by ``research.studies.runner.run_study``):

    python -m research.studies.worker --run OUT --variant NAME --seed S

trains the variant (``hybrid.train.run``, resuming from the newest checkpoint of ``OUT/variants/NAME/seedS/run``),
reloads the saved hybrid from disk, and evaluates it (or the teacher) item by item through ``headscope.evaluate``:
one ``eval/ITEM.json`` per item, items already written are skipped, items past the variant's evaluation time
budget (``[eval] timeout_s``) are written as "timeout". Step times go to ``progress.json`` and to the log.

A study with ``suite`` (e.g. ``suite = "fidelity"``) then runs each of those ``headscope.evaluate`` suites on the
trained variant against the teacher (``run_suites``; not on the teacher itself): ``research.train_hybrid.run.run_suite``
saves each evaluation to ``<suite>_parts/<evaluation>/`` as soon as it is done and reads the finished ones back
after a kill (tied to the saved weights' sha256), then all rows to ``<suite>/``; ``suites.json`` lists the suites
finished.

A SIGTERM (the runner's deadline) stops the worker where the next call continues: while training, after the step
under way is checkpointed (``_StopOnTerm``); while evaluating, after the item or suite part under way is finished
and saved (``_FinishOnTerm``), unless the runner's SIGKILL comes first.
"""
from __future__ import annotations

import argparse
import json
import signal
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from research.studies.config import SUITES_FILE, StudyConfig, eval_items, variant_dir

__all__ = ["work", "train_variant", "evaluate_variant", "run_suites", "StepTimer", "Stopped", "TrainingStopped",
           "EvaluationStopped"]

PRINT_AT = (1, 2, 3, 5, 10, 20)


def _write(path: Path, data: dict) -> None:
    from headscope.io import write_text

    write_text(path, json.dumps(data, indent=1, default=str))


class StepTimer:
    """``on_step`` callback of ``hybrid.train.run``: seconds per step (median from step 2, the first includes
    kernel compilation), printed at a few early steps, and written to progress.json at most every 2 s."""

    def __init__(self, folder: Path, key: str, steps: dict[str, int]) -> None:
        self.folder, self.key, self.steps = folder, key, steps
        self.stage, self.times, self.last, self.written = None, [], time.time(), 0.0

    def __call__(self, stage: str, step: int) -> None:
        now = time.time()
        if stage != self.stage:
            self.stage, self.times, self.first = stage, [], step
        else:
            self.times.append(now - self.last)
        self.last = now
        med = statistics.median(self.times) if self.times else None
        n = step - self.first + 1  # steps of this stage run in this process
        if n in PRINT_AT or step % 50 == 0:
            print(f"[{self.key}] {stage} step {step}/{self.steps.get(stage)}: "
                  + (f"{med:.3f} s/step (median of {len(self.times)})" if med is not None else "first step done"),
                  flush=True)
        if now - self.written > 2.0 or n in PRINT_AT:
            self.written = now
            _write(self.folder / "progress.json", {"phase": "train", "stage": stage, "step": step,
                                                   "steps": self.steps.get(stage), "s_per_step": med, "time": now})


def train_summary(out: Path, cfg) -> dict[str, Any]:
    """Steps, minutes, tokens, tokens/s and last losses per stage from the run's log.jsonl (resumes included)."""
    from hybrid.train.logs import read_log

    by: dict[str, dict[str, Any]] = {}
    for r in read_log(out / "log.jsonl"):
        if "loss" not in r or "stage" not in r:
            continue
        s = by.setdefault(r["stage"], {"tok_per_s": []})
        s.update(steps=r["step"], minutes=r.get("minutes"), tokens=r.get("tokens"), loss=r["loss"])
        s["tok_per_s"].append(r.get("tok_per_s", 0.0))
    stages = {}
    for st in cfg.stages:
        s = by.get(st.name, {})
        tps = s.pop("tok_per_s", [])
        stages[st.name] = {**s, "planned_steps": st.steps, "tok_per_s": statistics.median(tps) if tps else None,
                           "capped": bool(s) and s.get("steps", 0) < st.steps}
    return {"stages": stages, "minutes": round(sum(s.get("minutes") or 0 for s in stages.values()), 3),
            "tokens": sum(s.get("tokens") or 0 for s in stages.values()),
            "capped": any(s["capped"] for s in stages.values())}


class Stopped(Exception):
    """A SIGTERM (the runner's deadline) stopped the worker at a point the next call continues from."""


class TrainingStopped(Stopped):
    """A SIGTERM came while the variant trained (the runner's deadline): the step it was on is checkpointed, so the
    next call resumes from exactly there."""


class EvaluationStopped(Stopped):
    """A SIGTERM came while the variant was evaluated: the item or suite part under way was finished and saved
    (within the runner's STOP_WAIT_S), and the next call goes on from the next one."""


class _TermFlag:
    """Inside ``with``, a SIGTERM only sets ``asked`` (the work under way decides when to stop); outside, the usual
    SIGTERM handling is back."""

    def __init__(self) -> None:
        self.asked, self.old = False, None

    def _on_term(self, signum, frame) -> None:
        self.asked = True

    def __enter__(self):
        self.old = signal.signal(signal.SIGTERM, self._on_term)
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self.old)


class _FinishOnTerm(_TermFlag):
    """While evaluating, a SIGTERM (the runner stopping its workers at the study's deadline) lets the evaluation
    item or suite part under way finish and be saved; ``check`` then stops the worker (``EvaluationStopped``). The
    runner SIGKILLs a worker still running STOP_WAIT_S seconds after its SIGTERM, so a longer remainder is lost as
    before; a part near its end (a NIAH length, ~1 minute on an H100) is kept."""

    def check(self, after: str) -> None:
        if self.asked:
            raise EvaluationStopped(f"SIGTERM during the evaluation; stopped after {after} (saved)")


class _StopOnTerm(_TermFlag):
    """While training, a SIGTERM (the runner stopping its workers at the study's deadline) ends the step under way,
    which the trainer then checkpoints (``CheckpointAndStop``) before the worker stops, instead of killing the
    process and losing every step since the last periodic checkpoint. Not at a stage's last step (the stage's own
    checkpoint follows, and the training goes on to the next stage or the final save)."""

    def __init__(self, timer, last_steps: dict[str, int]) -> None:
        super().__init__()
        self.timer, self.last_steps = timer, last_steps

    def __call__(self, stage: str, step: int) -> None:
        from hybrid.train.trainer import CheckpointAndStop

        self.timer(stage, step)
        if self.asked and step < self.last_steps.get(stage, step + 1):
            raise CheckpointAndStop(f"SIGTERM at {stage} step {step}")


def train_variant(folder: Path, key: str) -> dict:
    """Train (or resume) the variant in ``folder``; writes and returns train_done.json. A SIGTERM while it trains
    checkpoints the step under way and raises ``TrainingStopped`` (``_StopOnTerm``)."""
    from hybrid.train import TrainConfig, run
    from hybrid.train.checkpoint import latest_checkpoint

    done = folder / "train_done.json"
    if done.exists():
        saved = folder / "run" / "hybrid"  # research.stage pack brings a folder back without the weights
        if (saved / "config.json").exists() and any(saved.glob("*.safetensors")):
            print(f"[{key}] training done earlier: skipped", flush=True)
            return json.loads(done.read_text())
        print(f"[{key}] trained earlier but the saved hybrid is missing (a folder restored without weights?): "
              "training again", flush=True)
        done.unlink()
    cfg = TrainConfig.from_file(folder / "train.json")
    resume = latest_checkpoint(Path(cfg.out)) is not None
    print(f"[{key}] training {'(resumed from ' + latest_checkpoint(Path(cfg.out)).path.name + ')' if resume else ''}"
          f": stages {[(s.name, s.steps, s.seq_len, s.batch_size) for s in cfg.stages]}", flush=True)
    t0 = time.time()
    timer = StepTimer(folder, key, {s.name: s.steps for s in cfg.stages})
    from hybrid.train.trainer import CheckpointAndStop

    with _StopOnTerm(timer, {s.name: s.steps for s in cfg.stages}) as stop:
        try:
            run(cfg, resume=resume, on_step=stop)
        except CheckpointAndStop as why:
            print(f"[{key}] stopped: {why}; checkpointed, the next call resumes there", flush=True)
            raise TrainingStopped(str(why)) from None
    summary = train_summary(Path(cfg.out), cfg)
    summary["seconds_this_process"] = round(time.time() - t0, 1)
    _write(done, summary)
    if stop.asked:  # the SIGTERM came at the training's last step: trained and saved; stop before the evaluation
        raise TrainingStopped("SIGTERM at the end of the training")
    return summary


def _load(spec, folder: Path, teacher: str, device: torch.device):
    from headscope.evaluate.api import load

    if not spec.trains:
        return load(teacher, device=str(device))
    import hybrid

    hybrid.register()
    model, tok = load(str(folder / "run" / "hybrid"), device=str(device))
    mask = json.loads((folder / "mask.json").read_text())
    saved = getattr(model.config, "head_mask", None) or {}
    if saved.get("fa_heads") != mask.get("fa_heads"):
        raise RuntimeError(f"{folder}: the saved hybrid carries another mask than mask.json")
    return model, tok


def evaluate_variant(cfg: StudyConfig, spec, folder: Path, key: str, device: torch.device,
                     guard: _FinishOnTerm | None = None) -> dict:
    """Every evaluation item not written yet (see the module docstring); returns {item: status}."""
    import headscope.evaluate as hev

    items = eval_items(cfg, cfg.train_length)
    edir = folder / "eval"
    edir.mkdir(exist_ok=True)
    skip = json.loads((edir / "_skip.json").read_text()) if (edir / "_skip.json").exists() else {}
    status: dict[str, str] = {}
    spent = 0.0
    for name, *_ in items:
        f = edir / f"{name}.json"
        if f.exists():
            d = json.loads(f.read_text())
            status[name], spent = d.get("status", "ok"), spent + float(d.get("seconds") or 0)
    todo = [it for it in items if it[0] not in status]
    if not todo:
        return status
    model, tok = _load(spec, folder, cfg.teacher, device)
    timeout = float(cfg.eval_setting("timeout_s"))
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()
    t_start = time.time()
    for i, (name, evaluation, over) in enumerate(todo):
        f = edir / f"{name}.json"
        base = {"item": name, "evaluation": evaluation, "config": over}
        if name in skip:
            _write(f, {**base, "status": "timeout", "note": skip[name], "seconds": None, "rows": []})
            status[name] = "timeout"
            continue
        used = spent + time.time() - t_start
        if used > timeout:
            _write(f, {**base, "status": "timeout", "seconds": None, "rows": [],
                       "note": f"the variant's evaluation budget ({timeout:.0f} s) was used ({used:.0f} s)"})
            status[name] = "timeout"
            continue
        now = time.time()
        _write(folder / "progress.json", {"phase": "eval", "item": name, "item_since": now, "done": len(status),
                                          "items": len(items), "time": now})
        with ac:
            df = hev.evaluate(model, [evaluation], tokenizer=tok, configs={evaluation: over}, seed=cfg.eval_setting("seed"),
                              batch_size=int(cfg.eval_setting("batch_size")),
                              token_budget=int(cfg.eval_setting("token_budget")), progress=False, workers=0)
        secs = round(time.time() - now, 2)
        rows = json.loads(df.to_json(orient="records"))
        _write(f, {**base, "status": "ok", "seconds": secs, "rows": rows})
        status[name] = "ok"
        print(f"[{key}] eval {name}: {secs:.1f} s", flush=True)
        if guard is not None:
            guard.check(f"eval {name}")
    return status


def run_suites(cfg: StudyConfig, spec, folder: Path, key: str, device: torch.device,
               guard: _FinishOnTerm | None = None) -> dict:
    """Each suite of ``cfg.suite`` not finished yet on the trained variant, against the teacher (see the module
    docstring), in float32 without autocast, as ``research/train_hybrid/run.py --suite`` evaluates a hybrid; the
    teacher itself is not compared with itself. Returns (and writes) SUITES_FILE's {suite: summary}."""
    if not cfg.suites or not spec.trains:
        return {}
    done_file = folder / SUITES_FILE
    done = json.loads(done_file.read_text()) if done_file.exists() else {}
    todo = [s for s in cfg.suites if s not in done]
    if not todo:
        return done
    from headscope.evaluate.api import load_teacher
    from headscope.io import file_sha256
    from research.train_hybrid.run import SuiteStopped, run_suite

    model, tok = _load(spec, folder, cfg.teacher, device)
    teacher = load_teacher(cfg.teacher, tok, device=str(device))
    weights = folder / "run" / "hybrid" / "model.safetensors"
    model_key = file_sha256(weights) if weights.is_file() else None  # ties the saved parts to these weights
    for name in todo:
        now = time.time()
        _write(folder / "progress.json", {"phase": "suite", "suite": name, "since": now, "time": now})
        print(f"[{key}] suite {name}: start", flush=True)
        try:
            rows = run_suite(model, tok, teacher, name, folder, model_key,
                             stop=None if guard is None else (lambda: guard.asked))
        except SuiteStopped as why:
            raise EvaluationStopped(str(why)) from None
        done[name] = {"seconds_this_call": round(time.time() - now, 1), "rows": len(rows),
                      "ok": int((rows["status"] == "ok").sum())}
        _write(done_file, done)
        print(f"[{key}] suite {name}: {done[name]['ok']} of {len(rows)} rows ok in {time.time() - now:.1f} s",
              flush=True)
    del model, teacher
    return done


def work(run_dir: Path, name: str, seed: int) -> dict:
    run_dir = Path(run_dir)
    cfg = StudyConfig.from_dict(json.loads((run_dir / "study.json").read_text()))
    spec = cfg.variant(name)
    folder = variant_dir(run_dir, name, seed)
    key = f"{name}/seed{seed}"
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = torch.device("cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    t0 = time.time()
    train = train_variant(folder, key) if spec.trains else None
    with _FinishOnTerm() as guard:
        status = evaluate_variant(cfg, spec, folder, key, device, guard)
        suites = run_suites(cfg, spec, folder, key, device, guard)
    result = {"variant": spec.to_dict(), "seed": seed, "train": train, "eval_status": status, "suites": suites,
              "device": str(device), "seconds_this_process": round(time.time() - t0, 1)}
    _write(folder / "result.json", result)
    _write(folder / "progress.json", {"phase": "done", "time": time.time()})
    print(f"[{key}] done ({(time.time() - t0) / 60:.2f} min in this process)", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, help="the study folder (holds study.json)")
    ap.add_argument("--variant", required=True)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    try:
        work(Path(a.run), a.variant, a.seed)
    except Stopped as why:
        print(f"[{a.variant}/seed{a.seed}] {why}", flush=True)
        return 128 + signal.SIGTERM  # as a process ended by the signal
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
