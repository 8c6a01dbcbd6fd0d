"""research.launch: the job table (parsing, refusals), --list, --dry-run of every job, the launcher's steps on a
fake kind (resume, --stop-after, failures), and the tiny CPU job end to end with an interruption (e2e)."""
from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pytest

from research.launch import CONTINUE, KINDS, Context, Job, JobError, JobKind, Step, get_job, load_jobs
from research.launch.__main__ import main
from research.launch import launcher

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


# ----------------------------------------------------------------------------- the job table

def write_jobs(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "jobs.toml"
    path.write_text(text)
    return path


def test_the_job_table_parses_and_names_the_required_jobs():
    jobs = load_jobs()
    assert {"tiny_hybrid", "smollm2_hybrid", "reference_hybrid", "studies_smollm2", "studies_reference",
            "report_heads_smollm2", "bench_receiver_gpu", "bench_whole_model", "gpu_tests"} <= set(jobs)
    for name, job in jobs.items():
        assert job.name == name and job.kind in KINDS
        assert all((ROOT / c).is_file() for c in job.config)
    assert jobs["tiny_hybrid"].device == "cpu" and jobs["smollm2_hybrid"].device == "cuda"
    assert jobs["smollm2_hybrid"].config == ("research/train_hybrid/smollm2.toml",)


@pytest.mark.parametrize("table, message", [
    ('[jobs.a]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\nsteps = 3\n',
     "unknown key(s) ['steps']"),
    ('[jobs.a]\nkind = "nope"\n', "kind = 'nope' is not one of"),
    ('[jobs.a]\nconfig = "research/train_hybrid/tiny.toml"\n', "no `kind`"),
    ('[jobs.a]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/missing.toml"\n',
     "config file research/train_hybrid/missing.toml does not exist"),
    ('[jobs.a]\nkind = "train_hybrid"\n', "takes 1 config file(s), this job names 0"),
    ('[jobs.a]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\ndevice = "tpu"\n',
     "device = 'tpu' is not one of"),
    ('[jobs.a]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\nargs = ["--out", "x"]\n',
     "set by the launcher"),
    ('[jobs.a]\nkind = "train_hybrid"\nconfig = "research/train_hybrid/tiny.toml"\nargs = [true]\n',
     "args must be strings or numbers"),
    ('[jobs."a b"]\nkind = "report_heads"\n', "must be a word"),
    ('note = "x"\n[jobs.a]\nkind = "report_heads"\n', "only [jobs.<name>] tables belong here"),
    ('[other]\n', "only [jobs.<name>] tables"),
    ('', "holds no [jobs.<name>] table"),
    ('[jobs.a\n', "is not valid TOML"),
])
def test_bad_job_tables_are_refused_naming_the_fix(tmp_path, table, message):
    with pytest.raises(JobError) as err:
        load_jobs(write_jobs(tmp_path, table))
    assert message in str(err.value)


def test_numbers_in_args_become_strings_and_an_unknown_job_is_named(tmp_path):
    path = write_jobs(tmp_path, '[jobs.a]\nkind = "report_heads"\nargs = ["--n-niah", 16, "--x", 0.5]\ndevice = "any"\n')
    assert get_job("a", path).args == ("--n-niah", "16", "--x", "0.5")
    with pytest.raises(JobError, match="no job 'tiny' in the job table .*did you mean"):
        get_job("tiny")
    with pytest.raises(JobError, match="does not exist"):
        load_jobs(tmp_path / "none.toml")


def test_list_and_kinds(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    for name, job in load_jobs().items():
        assert name in out
    assert main(["--kinds"]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in KINDS)
    assert main(["no_such_job"]) == 2
    assert "no job 'no_such_job'" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(load_jobs()))
def test_dry_run_of_every_job_resolves_its_configs(name, tmp_path, capsys):
    out = tmp_path / "r"
    assert main([name, "--dry-run", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    job = get_job(name)
    assert f"job {name}: kind {job.kind}" in text and "step 1/" in text
    if KINDS[job.kind].resolve is not None:
        assert "configs resolved: " in text
    for c in job.config:
        assert f"config {c} -> configs/{Path(c).name}" in text
    assert not out.exists()  # nothing written


def test_steps_write_into_the_results_folder():
    """Every program of a job reads its config copy and writes under the results folder (the old GPU call's
    report paths, docs/results and docs/figures, are gone); the one exception is the teacher's text, a cache that
    the jobs of one recipe share, written where the config's [data] teacher_corpus says."""
    out = Path("/tmp/r")
    for name, job in load_jobs().items():
        ctx, steps = launcher.plan(job, out, "cuda" if job.device != "cpu" else "cpu")
        for s in steps:
            if s.name == "teacher_text":
                assert s.module == "research.corpus.self_distill"
                continue
            if s.module:
                args = list(s.args)
                for flag in ("--out", "--json", "--out-dir", "--md", "--figures", "--run"):
                    if flag in args:
                        assert args[args.index(flag) + 1].startswith(str(out)), (name, s.name, flag)
                if "--config" in args:
                    assert args[args.index("--config") + 1].startswith(str(out / "configs")), (name, s.name)
    ctx, steps = launcher.plan(get_job("report_heads_smollm2"), out, "cuda")
    assert "--model" in steps[0].args and "smollm2-135m" in steps[0].args


def test_needs_follow_the_configs():
    needs = {name: KINDS[job.kind].needs(job) for name, job in load_jobs().items()}
    assert needs["smollm2_hybrid"] >= {"fla", "corpus", "gguf:smollm2-135m"}
    assert needs["studies_smollm2"] >= {"fla", "corpus", "gguf:smollm2-135m"}
    assert "gguf:smollm2-135m" not in needs["studies_reference"] and "corpus" in needs["studies_reference"]
    assert needs["tiny_hybrid"] == {"plotly"}  # the CPU job: the package's own text, no fla
    assert needs["report_heads_smollm2"] == {"gguf:smollm2-135m"} and needs["report_heads_reference"] == set()


# ----------------------------------------------------------------------------- the launcher on a fake kind

def _fake_steps(job: Job, ctx: Context) -> list[Step]:
    prog = lambda name, *a, **kw: Step(name, "fake_job_program", ("--out", str(ctx.out), "--name", name, *a), **kw)  # noqa: E731

    def second(c: Context) -> None:
        """write second.done"""
        (c.out / "second.done").write_text("ok")

    steps = [prog("first", *(("--stop-once",) if "stop-once" in job.args else ()), *(("--fail",) if "fail" in job.args
                                                                                    else ()),
                  done="first.done", resume=lambda c: ("--resume",) if (c.out / "first.calls").exists() else (),
                  stop_flag="--stop-after", continue_codes=(CONTINUE,)),
             Step("second", call=second, done="second.done"),
             prog("opt", *(("--fail",) if "fail-optional" in job.args else ()), optional=True, group="g"),
             prog("opt2", group="g"),
             prog("table", always=True)]
    return steps


@pytest.fixture
def fake_kind(monkeypatch, tmp_path):
    KINDS.register("fake", JobKind("a stand-in kind for tests", _fake_steps))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(launcher, "RUNS", tmp_path / "runs")
    yield
    KINDS.unregister("fake")


def fake_job(*args: str, device: str = "cpu") -> Job:
    return Job(name="fake_job", kind="fake", args=args, device=device)


def calls(out: Path, name: str) -> list[str]:
    path = out / f"{name}.calls"
    return path.read_text().splitlines() if path.exists() else []


def test_stop_resume_and_skip_finished_steps(fake_kind, tmp_path, capsys):
    job = fake_job("stop-once")
    out = tmp_path / "runs" / "2026-12-03_fake_job"
    assert launcher.launch(job, stop_after=100, today=dt.date(2026, 12, 3)) == CONTINUE
    text = capsys.readouterr().out
    assert "stopped cleanly" in text and "continue with `python -m research.launch fake_job --resume`" in text
    assert calls(out, "first") == [f"--out {out} --name first --stop-once --stop-after 100"]
    assert not (out / "second.done").exists() and len(calls(out, "table")) == 1  # an `always` step still runs
    state = json.loads((out / "steps.json").read_text())["steps"]
    assert state["first"]["status"] == "stopped" and "second" not in state

    with pytest.raises(JobError, match="pass --resume to continue it"):
        launcher.launch(job, today=dt.date(2026, 12, 3))
    # --resume finds the newest runs/*_fake_job on another day too
    assert launcher.launch(job, resume=True, today=dt.date(2026, 12, 4)) == 0
    assert calls(out, "first")[1].endswith("--resume") and (out / "second.done").exists()
    assert len(calls(out, "opt")) == len(calls(out, "opt2")) == 1 and len(calls(out, "table")) == 2

    assert launcher.launch(job, resume=True) == 0  # everything finished: only the `always` step runs
    text = capsys.readouterr().out
    assert text.count("already complete, skipped") == 4 and len(calls(out, "first")) == 2
    assert len(calls(out, "table")) == 3
    record = json.loads((out / "job.json").read_text())
    assert record["job"] == job.to_dict() and [c["exit"] for c in record["calls"]] == [CONTINUE, 0, 0]
    assert json.loads((out / "environment.json").read_text())["torch"]
    assert (out / "logs" / "first.log").read_text().count("=== ") == 2

    with pytest.raises(JobError, match="with other args"):
        launcher.launch(fake_job("other"), resume=True)


def test_failures_stop_the_job_and_optional_ones_do_not(fake_kind, tmp_path, capsys):
    assert launcher.launch(fake_job("fail"), out=tmp_path / "f") == launcher.FAILED
    state = json.loads((tmp_path / "f" / "steps.json").read_text())["steps"]
    assert state["first"]["status"] == "failed" and state["first"]["rc"] == 1 and "second" not in state
    assert "failed (exit 1)" in capsys.readouterr().out
    assert launcher.launch(fake_job("fail-optional"), out=tmp_path / "o") == 0
    state = json.loads((tmp_path / "o" / "steps.json").read_text())["steps"]
    assert state["opt"]["status"] == "failed" and state["opt2"]["status"] == "done"
    assert "optional: the job goes on" in capsys.readouterr().out


def test_refusals_before_anything_runs(fake_kind, tmp_path, monkeypatch):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.txt").write_text("not a results folder")
    with pytest.raises(JobError, match="not a launcher's folder"):
        launcher.launch(fake_job(), out=tmp_path / "x")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(JobError, match="expects a CUDA GPU and this machine has none"):
            launcher.launch(fake_job(device="cuda"), out=tmp_path / "c")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(JobError, match="--stop-after under torchrun"):
        launcher.launch(fake_job(), out=tmp_path / "t", stop_after=10)


def test_default_results_folder_is_dated_and_resume_takes_the_newest(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher, "RUNS", tmp_path)
    job = get_job("tiny_hybrid")
    assert launcher.results_folder(job, None, False, dt.date(2026, 12, 3)) == tmp_path / "2026-12-03_tiny_hybrid"
    for day in ("2026-12-01", "2026-12-02"):
        (tmp_path / f"{day}_tiny_hybrid").mkdir()
        (tmp_path / f"{day}_tiny_hybrid" / "job.json").write_text("{}")
    assert launcher.results_folder(job, None, True, dt.date(2026, 12, 3)) == tmp_path / "2026-12-02_tiny_hybrid"
    assert launcher.results_folder(job, tmp_path / "mine", True) == (tmp_path / "mine").resolve()


def test_a_missing_corpus_names_the_fix(monkeypatch, tmp_path):
    import research.prepare_corpus as pc

    monkeypatch.setattr(pc, "CORPUS", tmp_path / "corpus")
    monkeypatch.setattr(pc, "GZ", tmp_path / "gz")
    monkeypatch.setattr(pc.ensure_corpus, "__defaults__", (tmp_path / "corpus", tmp_path / "gz"))
    with pytest.raises(JobError, match="python -m research.prepare_corpus"):
        launcher.prepare({"corpus"}, "cpu")


# ----------------------------------------------------------------------------- the tiny CPU job, for real

@pytest.mark.e2e
def test_tiny_job_end_to_end_stopped_then_resumed(tmp_path, monkeypatch):
    """tiny_hybrid's config with a checkpoint every 2 steps: --stop-after stops the training after its first step,
    checkpointed there (exit 3), --resume continues from it (no step trained twice) and evaluates; a third call
    finds everything done."""
    import subprocess
    import sys

    cfg = tmp_path / "tiny_ckpt.toml"
    cfg.write_text((ROOT / "research/train_hybrid/tiny.toml").read_text().replace('eval = "none"',
                                                                                  'eval = "none"\ncheckpoint_every = 2'))
    jobs = write_jobs(tmp_path, f'[jobs.tiny_ckpt]\nkind = "train_hybrid"\nconfig = "{cfg}"\n'
                                f'args = ["--tiny", "--n", "1", "--no-throughput", "--max-eval-length", "256"]\n'
                                f'device = "cpu"\n')
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "research.launch", "tiny_ckpt", "--jobs", str(jobs), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd + ["--stop-after", "1"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == CONTINUE, p.stdout[-3000:] + p.stderr[-3000:]
    assert "continue with `python -m research.launch tiny_ckpt --resume" in p.stdout
    assert (out / "run" / "checkpoints" / "LATEST").read_text().strip() == "s1-align-000001"  # not the periodic 2
    assert not (out / "results.json").exists()

    p = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["train"]["minutes_by_stage"]) == {"align", "distill", "long"}
    log = [json.loads(line) for line in (out / "run" / "log.jsonl").read_text().splitlines()]
    trained = [(r["stage"], r["step"]) for r in log if "loss" in r and "step" in r and "event" not in r]
    assert len(trained) == len(set(trained)) and ("align", 1) in trained and ("long", 2) in trained
    assert any(r.get("event") == "resume" for r in log)
    assert (out / "configs" / "tiny_ckpt.toml").read_text() == cfg.read_text()
    assert {"job.json", "environment.json", "steps.json", "mask.json", "eval_rows.csv"} <= {p.name for p in
                                                                                              out.iterdir()}
    assert "--resume" in (out / "logs" / "train.log").read_text()

    mtime = (out / "results.json").stat().st_mtime
    p = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0 and "already complete, skipped" in p.stdout
    assert (out / "results.json").stat().st_mtime == mtime


def test_program_output_is_logged_as_it_arrives(tmp_path, capsys):
    """A progress bar's redrawn states (ended by a carriage return) reach the log at most every 2 s and a captured
    console not at all; whole lines reach both, stamped in the log."""
    import subprocess
    import sys

    code = ("import sys, time\nfor i in range(5):\n    sys.stdout.write(f'bar {i}\\r'); sys.stdout.flush()\n"
            "print('done'); sys.stdout.write('no newline at the end')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)
    pump = launcher._tee(proc, tmp_path / "x.log", "[x] ")
    proc.wait()
    pump.join()
    assert capsys.readouterr().out == "[x] done\n[x] no newline at the end\n"
    lines = (tmp_path / "x.log").read_text().splitlines()
    assert [line.split(maxsplit=1)[1] for line in lines] == ["bar 0", "done", "no newline at the end"]
    assert all(float(line.split()[0]) >= 0 for line in lines)


def test_a_recipe_with_teacher_text_makes_it_first_when_missing(tmp_path):
    from research.launch import get_job
    from research.launch import kinds

    steps = kinds._teacher_text_steps(get_job("smollm2_broad_hybrid"))
    assert [s.name for s in steps] == ["teacher_text"] and steps[0].module == "research.corpus.self_distill"
    assert steps[0].args[:4] == ("--model", "smollm2-135m", "--out", "data/corpus/teacher")
    assert "--max-minutes" in steps[0].args and kinds._teacher_text_steps(get_job("smollm2_hybrid")) == []
    steps = kinds._teacher_text_steps(get_job("smollm2_broad_hybrid"), root=tmp_path)
    assert steps[0].always  # re-checked on every call, also when the results folder records it as done
    assert steps[0].when(None) is True  # no teacher.txt under this root: made first
    (tmp_path / "data" / "corpus" / "teacher").mkdir(parents=True)
    (tmp_path / "data" / "corpus" / "teacher" / "teacher.txt").write_text("x")
    assert steps[0].when(None) is False


def test_every_mask_a_job_names_is_a_mask_in_the_checkout():
    # a job that trains on a committed mask (made once by the whole method) reads it from the checkout on any machine
    from headscope.mask import HeadMask

    root = Path(__file__).resolve().parents[2]
    named = [(j.name, str(j.args[list(j.args).index("--mask") + 1])) for j in load_jobs().values() if "--mask" in j.args]
    assert ("smollm2_broad_hybrid", "research/train_hybrid/smollm2_broad_mask.json") in named
    masks = {name: HeadMask.from_json((root / path).read_text()) for name, path in named}  # each one loads
    m = masks["smollm2_broad_hybrid"]
    assert (m.n_layers, m.n_heads, len(m.fa_heads)) == (30, 9, 33)  # SmolLM2-135M, 1/8 of its 90 KV groups
