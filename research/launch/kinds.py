"""Job kinds: what a job of each kind runs, as a list of steps, and what it needs on the machine.

    KINDS.entry("train_hybrid").steps(job, ctx)   # -> [Step, ...]
    KINDS.entry("studies").needs(job)            # -> {"fla", "corpus", "gguf:smollm2-135m", "plotly"}

A step is one program (``python -m <module> ...``, run from the repository root) or one in-process function. The
launcher (research.launch.run) runs the steps in order, skips those a resumed job finished, passes ``--stop-after``'s
seconds left to the programs that can stop cleanly, and writes everything into the job's results folder.

A new kind is one entry (``KINDS.register(name, JobKind(...))``) and a test (tests/research/test_launch.py).
The needs name what a job requires beyond the repository: ``fla`` (fla-core, the GDN kernels, on CUDA),
``plotly`` (figures; optional), ``corpus`` (data/corpus/train.txt), ``gguf:<model>`` (a registry model's GGUF,
headscope/zoo.py); research.stage turns them into the paths to carry to a remote GPU machine.
"""
from __future__ import annotations

import json
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from headscope.registry import Registry

if TYPE_CHECKING:
    from research.launch.jobs import Job

__all__ = ["KINDS", "JobKind", "Step", "Context", "CONTINUE"]

CONTINUE = 3  # exit code of a program (and of the launcher) that stopped cleanly: run again with --resume


@dataclass(frozen=True)
class Context:
    """Where a job runs: its results folder, its config copies (same order as ``job.config``) and the Python."""

    out: Path
    configs: tuple[Path, ...]
    python: str
    device: str  # "cuda" or "cpu": what this machine gives the job
    world: int = 1  # processes under torchrun (1: none)


@dataclass(frozen=True)
class Step:
    """One program (``module`` + ``args``) or one function (``call(ctx)``).

    ``done``: a file (relative to the results folder) that exists once the step has finished; ``resume(ctx)``: extra
    arguments when continuing (e.g. ``--resume`` when checkpoints exist); ``stop_flag``: the program's flag that
    takes the seconds left (``--stop-after``), less ``stop_margin``; ``continue_codes``: its exit codes for "stopped
    cleanly, run again to continue"; ``main_only``: under torchrun only rank 0 runs it (the others skip it);
    ``optional``: a failure is reported, not fatal; ``always``: runs on every call (a table of whatever exists),
    even after an earlier step stopped; ``group``: consecutive steps of one group run side by side; ``during(ctx)``:
    called every 15 s while the step runs; ``when(ctx)``: the step runs only if it returns True."""

    name: str
    module: str = ""
    args: tuple[str, ...] = ()
    call: Callable[[Context], None] | None = None
    done: str | None = None
    resume: Callable[[Context], tuple[str, ...]] | None = None
    stop_flag: str | None = None
    stop_margin: float = 0.0
    continue_codes: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    main_only: bool = False
    optional: bool = False
    always: bool = False
    group: str | None = None
    during: Callable[[Context], None] | None = None
    when: Callable[[Context], bool] | None = None

    def __post_init__(self) -> None:
        if bool(self.module) == (self.call is not None):
            raise ValueError(f"step {self.name!r}: give a module or a call, not both or neither")

    def command(self, ctx: Context, extra: tuple[str, ...] = ()) -> list[str]:
        return [ctx.python, "-m", self.module, *self.args, *extra]

    def describe(self, ctx: Context) -> str:
        if self.call is not None:
            return f"(in the launcher) {self.call.__doc__.strip().splitlines()[0] if self.call.__doc__ else ''}"
        return " ".join(["python", "-m", self.module, *self.args])


@dataclass(frozen=True)
class JobKind:
    """``steps(job, ctx)``: the steps; ``configs``: how many config files a job of this kind names (min, max);
    ``needs(job)``: what it needs on the machine (module docstring); ``check(job)``: a problem with the job's
    arguments (a message) or None; ``resolve(job)``: the configs loaded and validated the way the program loads them
    (``--dry-run`` shows it; raises on a bad config), a one-line summary."""

    summary: str
    steps: Callable[["Job", Context], list[Step]]
    configs: tuple[int, int] = (0, 0)
    needs: Callable[["Job"], set[str]] = lambda job: set()
    check: Callable[["Job"], str | None] | None = None
    resolve: Callable[["Job"], str] | None = None  # load and validate the configs as the program will; a summary


KINDS: Registry[JobKind] = Registry("job kind", owner="research.launch.kinds.KINDS")


# ----------------------------------------------------------------------------- what a job's configs say

def _toml(path: Path) -> dict[str, Any]:
    return tomllib.loads(Path(path).read_text())


def _arg(job: "Job", flag: str, default: str | None = None) -> str | None:
    """The value of ``flag`` in the job's args (``--flag V`` or ``--flag=V``), else ``default``."""
    args = list(job.args)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default


def _registry_model(name: str | None) -> str | None:
    """``name`` if it is a registry model whose weights come from a GGUF (headscope/zoo.py), else None."""
    from headscope.zoo import MODELS

    return name if name in MODELS else None


def _needs_of_train_config(cfg: dict[str, Any], data: dict[str, Any]) -> set[str]:
    needs = set()
    corpus = str(data.get("corpus", "heldout"))
    if corpus.endswith("manifest.json"):
        needs.add("broad_corpus")  # research.corpus.build's sources (research.stage split-corpus)
    if corpus.startswith("data/corpus") and not corpus.endswith("manifest.json") or \
            str(data.get("haystack", "train")) == "train" and corpus != "heldout":
        needs.add("corpus")  # research.prepare_corpus's train.txt / heldout.txt (the haystack "train" among them)
    model = _registry_model(cfg.get("teacher"))
    if model:
        needs.add(f"gguf:{model}")
    return needs


def _hybrid_needs(job: "Job") -> set[str]:
    cfg = _toml(job.config_paths[0])
    needs = _needs_of_train_config(cfg, cfg.get("data", {})) | {"plotly"}
    return needs | ({"fla"} if job.device != "cpu" else set())


def _study_needs(job: "Job") -> set[str]:
    cfg = _toml(job.config_paths[0])
    needs = _needs_of_train_config(cfg, cfg.get("train", {}).get("data", {})) | {"plotly"}
    return needs | ({"fla"} if job.device != "cpu" else set())


def _model_needs(job: "Job") -> set[str]:
    model = _registry_model(_arg(job, "--model", "default"))
    return {f"gguf:{model}"} if model else set()


# ----------------------------------------------------------------------------- train_hybrid, hybrid_throughput

def _has_checkpoint(run: Path) -> bool:
    return (run / "checkpoints" / "LATEST").is_file()


def _run_py_check(job: "Job") -> str | None:
    owned = {"--config", "--out", "--resume", "--stop-after", "--throughput-only"}
    taken = sorted(owned & {a.split("=", 1)[0] for a in job.args})
    if taken:
        return (f"args {taken} are set by the launcher (the config copy, the results folder, --resume, "
                "--stop-after): leave them out of `args`")
    return None


# the teacher's own text for a config with [data] teacher_corpus, made on the machine that trains when it is not
# there yet: a fixed number of samples (6 chunks of 2,048: ~90 s and ~2.9 M new tokens for SmolLM2-135M on one
# H200), so that every machine samples the same prompts; the minutes are only a safety cap (docs/research.md)
SELF_DISTILL_ARGS = ("--n", "12288", "--max-minutes", "4", "--no-progress")


def _teacher_text_steps(job: "Job", root: Path | None = None, data: dict[str, Any] | None = None) -> list[Step]:
    """``data``: the config's data table (default: its ``[data]``, where a train_hybrid config has it)."""
    cfg = _toml(job.config_paths[0])
    folder = (cfg.get("data", {}) if data is None else data).get("teacher_corpus", "")
    if not folder or folder.endswith(".txt"):
        return []
    from hybrid.train.text import TEACHER_TEXT

    root = Path(__file__).resolve().parents[2] if root is None else root  # where the steps run (the checkout)
    text = Path(folder) / TEACHER_TEXT
    return [Step("teacher_text", "research.corpus.self_distill",
                 ("--model", str(cfg.get("teacher", "default")), "--out", folder, *SELF_DISTILL_ARGS),
                 main_only=True, always=True,  # checked on every call: a fresh machine has lost the text a carried
                 # results folder says was made
                 when=lambda c: not (text if text.is_absolute() else root / text).is_file())]


def _train_hybrid_steps(job: "Job", ctx: Context) -> list[Step]:
    out = ctx.out
    steps = _teacher_text_steps(job) + [Step("train", "research.train_hybrid.run", ("--config", str(ctx.configs[0]), "--out", str(out),
                                                         *job.args),
                  done="results.json", resume=lambda c: ("--resume",) if _has_checkpoint(c.out / "run") else (),
                  stop_flag="--stop-after", continue_codes=(CONTINUE,))]
    if ctx.device == "cuda" and "--no-parity" not in job.args:  # the trained hybrid under each precision and
        #                                                              kernel backend (the same function?)
        steps.append(Step("backend_parity", "research.train_hybrid.backend_parity",
                          ("--model", str(out / "run" / "hybrid"), "--out", str(out / "backend_parity.json")),
                          done="backend_parity.json", main_only=True, optional=True,
                          when=lambda c: (c.out / "run" / "hybrid" / "config.json").is_file()))
    return steps


def _resolve_train(job: "Job") -> str:
    from hybrid.train import TrainConfig

    c = TrainConfig.from_file(job.config_paths[0], mask="mask.json", out="run")  # run.py sets both
    stages = ", ".join(f"{s.name} {s.steps} x {s.batch_size} x {s.seq_len}" for s in c.stages)
    return f"teacher {c.teacher}, device {c.device}; stages: {stages}"


def _resolve_study(job: "Job") -> str:
    from research.studies.config import StudyConfig

    c = StudyConfig.from_file(job.config_paths[0], dry_run="--dry-run" in job.args, profile=_arg(job, "--profile"),
                              steps_scale=float(_arg(job, "--steps-scale", "1")))
    return (f"teacher {c.teacher}, {len(c.variants)} variants x seeds {list(c.seeds)}, device {c.device}, "
            f"parallel {c.parallel}")


KINDS.register("train_hybrid", JobKind(
    "research/train_hybrid/run.py: mask, the three stages, the saved hybrid evaluated against the teacher "
    "(results.json); on CUDA also the trained hybrid's backend parity",
    _train_hybrid_steps, configs=(1, 1), needs=_hybrid_needs, check=_run_py_check, resolve=_resolve_train))

KINDS.register("hybrid_throughput", JobKind(
    "research/train_hybrid/run.py --throughput-only: the untrained hybrid's stage-2 step and the teacher's training "
    "step over a sweep of batch sizes (throughput.json)",
    lambda job, ctx: [Step("throughput", "research.train_hybrid.run",
                           ("--config", str(ctx.configs[0]), "--out", str(ctx.out), "--throughput-only", *job.args),
                           done="throughput.json", main_only=True)],
    configs=(1, 1), needs=lambda job: _hybrid_needs(job) - {"corpus", "plotly"}, check=_run_py_check,
    resolve=_resolve_train))

KINDS.register("trainer_throughput", JobKind(
    "research/train_hybrid/trainer_throughput.py: hybrid.train.run on the config, each stage's tokens/s and MFU "
    "from its log (trainer_throughput.json)",
    lambda job, ctx: [Step("trainer_throughput", "research.train_hybrid.trainer_throughput",
                           ("--config", str(ctx.configs[0]), "--out", str(ctx.out / "run"), *job.args),
                           done="run/trainer_throughput.json")],
    configs=(1, 1), needs=lambda job: _hybrid_needs(job) - {"plotly"}, resolve=_resolve_train))


# ----------------------------------------------------------------------------- studies

def _drop_finished_checkpoints(ctx: Context) -> None:
    """A finished variant (result.json: trained, saved, evaluated) needs its checkpoints no more (SmolLM2's are
    ~1.7 GB each): removed while the study runs."""
    for d in (ctx.out / "study" / "variants").glob("*/seed*"):
        if (d / "result.json").is_file() and (d / "run" / "checkpoints").is_dir():
            shutil.rmtree(d / "run" / "checkpoints", ignore_errors=True)


def _studies_check(job: "Job") -> str | None:
    taken = sorted({"--config", "--out", "--deadline-s"} & {a.split("=", 1)[0] for a in job.args})
    return (f"args {taken} are set by the launcher (the config copy, the results folder, --stop-after): leave them "
            "out of `args`") if taken else None


def _studies_steps(job: "Job", ctx: Context) -> list[Step]:
    env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           # fewer idle blocks held by each worker's caching allocator (the workers share the GPU's memory)
           "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    # a study whose [train.data] names a teacher_corpus (the broad recipe's teacher text): made first when missing
    teacher_text = _teacher_text_steps(job, data=_toml(job.config_paths[0]).get("train", {}).get("data", {}))
    return teacher_text + [Step("study", "research.studies.run_studies",
                 ("--config", str(ctx.configs[0]), "--out", str(ctx.out / "study"), "--status-every", "30", *job.args),
                 done="study/studies.json", stop_flag="--deadline-s", stop_margin=30.0, continue_codes=(CONTINUE,),
                 env=env, main_only=True, during=_drop_finished_checkpoints),
            Step("tables", "research.studies.render_studies", ("--run", str(ctx.out / "study"), "--out", str(ctx.out)),
                 main_only=True, always=True, optional=True,
                 when=lambda c: (c.out / "study" / "studies.json").is_file())]


KINDS.register("studies", JobKind(
    "research/studies/run_studies.py: every variant of the study trained and evaluated side by side, resumable; "
    "then render_studies.py's tables.md and studies.html",
    _studies_steps, configs=(1, 1), needs=_study_needs, check=_studies_check, resolve=_resolve_study))


# ----------------------------------------------------------------------------- head reports and model benchmarks

def _out_check(*flags: str):
    def check(job: "Job") -> str | None:
        taken = sorted(set(flags) & {a.split("=", 1)[0] for a in job.args})
        return f"args {taken} are set by the launcher (the results folder): leave them out of `args`" if taken else None
    return check


KINDS.register("report_heads", JobKind(
    "research/report_heads.py: the head report of one model (report/heads.json, report/heads.md, figures/)",
    lambda job, ctx: [Step("report", "research.report_heads",
                           (*job.args, "--out-dir", str(ctx.out / "report"), "--md", str(ctx.out / "report" /
                                                                                        "heads.md"),
                            "--figures", str(ctx.out / "figures")),
                           done="report/heads.json", main_only=True)],
    needs=_model_needs, check=_out_check("--out-dir", "--md", "--figures")))

KINDS.register("task_accuracy", JobKind(
    "research/task_accuracy.py: a model's clean accuracy on every task (task_accuracy.json)",
    lambda job, ctx: [Step("task_accuracy", "research.task_accuracy",
                           (*job.args, "--out", str(ctx.out / "task_accuracy.json")),
                           done="task_accuracy.json", main_only=True)],
    needs=_model_needs, check=_out_check("--out")))


def _script(summary: str, module: str, *, done: str | None = None, out_args: tuple[str, ...] = (),
            needs: Callable[["Job"], set[str]] = lambda job: set()) -> JobKind:
    """A one-program kind: ``python -m module ARGS OUT_ARGS`` with ``$OUT`` set to the results folder (the
    benchmarks write their JSON there); ``out_args`` may name ``{out}``, the results folder."""
    def steps(job: "Job", ctx: Context) -> list[Step]:
        extra = tuple(a.format(out=ctx.out) for a in out_args)
        return [Step(module.rsplit(".", 1)[-1], module, (*job.args, *extra), done=done, main_only=True,
                     env={"OUT": str(ctx.out)})]
    flags = tuple(a for a in out_args if a.startswith("--"))
    return JobKind(summary, steps, needs=needs, check=_out_check(*flags) if flags else None)


_FLA = lambda job: {"fla"}  # noqa: E731

KINDS.register("bench_receiver_gpu", _script(
    "research/bench_receiver_gpu.py: receiver scores of every head, timed against a naive loop and TransformerLens "
    "(random Qwen3-1.7B shape, or --model)", "research.bench_receiver_gpu", needs=_model_needs))
KINDS.register("bench_evaluate", _script(
    "research/bench_evaluate.py: the evaluation harness's numbers and timing (bench_evaluate.json, eval/)",
    "research.bench_evaluate", done="bench_evaluate.json",
    out_args=("--json", "{out}/bench_evaluate.json", "--out", "{out}/eval")))
KINDS.register("bench_whole_model", _script(
    "research/bench_whole_model_gpu.py: whole-model decode and prefill cost of the hybrids at long context",
    "research.bench_whole_model_gpu", done="bench_whole_model.json", needs=_FLA))
KINDS.register("bench_fused_loss", _script(
    "research/bench_fused_loss.py: stage 2's loss, naive against fused", "research.bench_fused_loss",
    done="bench_fused_loss.json"))
KINDS.register("bench_kernels", _script(
    "research/bench_kernels_gpu.py: fla GDN chunk and SDPA kernel timings", "research.bench_kernels_gpu",
    done="bench_kernels.json", needs=_FLA))
KINDS.register("count_decode_ops", _script(
    "research/count_decode_ops.py: kernels per decode step and layer, teacher against hybrid (and, with --times, "
    "where the step's time goes)", "research.count_decode_ops", done="count_decode_ops.json",
    out_args=("--json", "{out}/count_decode_ops.json"), needs=_FLA))
KINDS.register("decode_attention_sweep", _script(
    "research/perf/decode_attention_sweep.py: the split-KV decode attention kernel's tunings timed at the decode "
    "benchmark's shapes", "research.perf.decode_attention_sweep", done="decode_attention_sweep.json"))
KINDS.register("gemv_sweep", _script(
    "research/perf/gemv_sweep.py: the decode GEMV kernel's tunings timed against cuBLAS at the decode benchmark's "
    "projection shapes", "research.perf.gemv_sweep", done="gemv_sweep.json"))
KINDS.register("gdn_step_sweep", _script(
    "research/perf/gdn_step_sweep.py: the fused GDN decode step kernel's tunings timed at the decode benchmark's "
    "shape", "research.perf.gdn_step_sweep", done="gdn_step_sweep.json"))
KINDS.register("fla_parity", _script(
    "research/fla_parity_gpu.py: fla's GDN kernels against the PyTorch reference", "research.fla_parity_gpu",
    needs=_FLA))
KINDS.register("gpu_hybrid_all", _script(
    "research/gpu_hybrid_all.py: every hybrid-layer GPU measurement under a wall-clock budget",
    "research.gpu_hybrid_all", done="gpu_hybrid.json", needs=_FLA))
KINDS.register("bench_sharded_scoring", _script(
    "research/bench_sharded_scoring.py: receiver scores sharded over N processes against one (torchrun inside)",
    "research.bench_sharded_scoring", done="bench_sharded_scoring.json", out_args=("--out", "{out}")))
KINDS.register("bench_distributed_train", _script(
    "research/bench_distributed_train.py: stage 2 on 1 process against 2 with DDP and FSDP (torchrun inside)",
    "research.bench_distributed_train", done="bench_distributed_train.json", out_args=("--out", "{out}"),
    needs=lambda job: {"fla", "corpus"}))


def _pytest_steps(job: "Job", ctx: Context) -> list[Step]:
    return [Step("pytest", "pytest", ("-m", "gpu", "-q", "-p", "no:cacheprovider", "--durations=15",
                                      f"--junitxml={ctx.out / 'gpu_tests.xml'}", *job.args),
                 done="gpu_tests.xml", main_only=True)]


KINDS.register("gpu_tests", JobKind("pytest -m gpu on the given test paths (gpu_tests.xml)", _pytest_steps,
                                    needs=_FLA))


# ----------------------------------------------------------------------------- the reference model

def _reference_steps(job: "Job", ctx: Context) -> list[Step]:
    model = ctx.out / "model"
    env = {"TOKENIZERS_PARALLELISM": "false"}
    ppl_only = ("--ppl-only",) if "--text-only" in job.args else ()
    return [Step("train", "research.reference.train_reference", ("--out", str(model), *job.args),
                 done="model/train_summary.json", env=env, main_only=True,
                 resume=lambda c: ("--resume",) if any((c.out / "model" / "checkpoints").glob("*")) else ()),
            Step("eval", "research.reference.eval_reference",
                 ("--model", str(model), "--json", str(ctx.out / "eval.json"), *ppl_only),
                 done="eval.json", env=env, main_only=True)]


KINDS.register("reference_train", JobKind(
    "research/reference/train_reference.py then eval_reference.py: one training of the reference model "
    "(model/, eval.json)", _reference_steps, needs=lambda job: {"corpus"},
    check=_out_check("--out", "--resume")))


def _sweep_config(path: Path) -> dict[str, Any]:
    cfg = _toml(path)
    missing = sorted({"minutes", "workers", "base", "variants", "shipped_eval"} - set(cfg))
    if missing:
        raise ValueError(f"{path}: missing {missing} (minutes, workers, base, shipped_eval, [variants])")
    return cfg


def _sweep_score(ev: dict) -> tuple[float, float]:
    """Checks passed, then multi-key + binding accuracy (the bar a continuation must beat)."""
    return (sum(ev["checks"].values()), ev["multikey"] + ev["reasoning"]["binding"])


def _sweep_check(job: "Job") -> str | None:
    try:
        _sweep_config(job.config_paths[0])
    except (ValueError, tomllib.TOMLDecodeError) as err:
        return str(err)
    return None


def _sweep_steps(job: "Job", ctx: Context) -> list[Step]:
    from headscope.io import write_text

    REPO = Path(__file__).resolve().parents[2]  # = research.launch.jobs.REPO (jobs imports this module)

    copy = ctx.configs[0]
    cfg = _sweep_config(copy if copy.is_file() else job.config_paths[0])  # the copy once the job has started
    env = {"TOKENIZERS_PARALLELISM": "false"}
    steps = []
    for name, flags in cfg["variants"].items():
        steps.append(Step(f"train_{name}", "research.reference.train_reference",
                          ("--out", str(ctx.out / name), "--max-minutes", str(cfg["minutes"]), "--workers",
                           str(cfg["workers"]), *cfg["base"], *flags),
                          done=f"{name}/train_summary.json", env=env, main_only=True, group="train"))
    for name in cfg["variants"]:
        steps.append(Step(f"eval_{name}", "research.reference.eval_reference",
                          ("--model", str(ctx.out / name), "--json", str(ctx.out / name / "eval.json")),
                          done=f"{name}/eval.json", env=env, main_only=True, group="eval", optional=True))

    def pick(c: Context) -> None:
        """pick the variant that beats the starting model's eval (sweep.json)"""
        shipped = json.loads((REPO / cfg["shipped_eval"]).read_text())
        rows, best = {}, None
        for name, flags in cfg["variants"].items():
            path = c.out / name / "eval.json"
            if not path.is_file():
                rows[name] = {"flags": flags, "error": "no eval.json (training or evaluation failed: see logs/)"}
                continue
            ev = json.loads(path.read_text())
            rows[name] = {"flags": flags, "score": _sweep_score(ev),
                          **{k: ev[k] for k in ("niah_mean", "niah_min_depth", "multikey", "reasoning", "knockout",
                                                "checks", "ppl") if k in ev}}
            if _sweep_score(ev) > _sweep_score(shipped) and (best is None or _sweep_score(ev) > rows[best]["score"]):
                best = name
        summary = {"shipped_eval": cfg["shipped_eval"], "shipped_score": _sweep_score(shipped), "best": best,
                   "variants": rows}
        write_text(c.out / "sweep.json", json.dumps(summary, indent=1))
        print(f"[sweep] best: {best or 'none beats the starting model'}; "
              + "; ".join(f"{n}: {r.get('score', r.get('error'))}" for n, r in rows.items()), flush=True)

    return [*steps, Step("pick", call=pick, done="sweep.json", main_only=True)]


KINDS.register("reference_sweep", JobKind(
    "continuations of the reference model trained side by side, each evaluated; sweep.json names the best "
    "(config: minutes, workers, base flags, shipped_eval, [variants])",
    _sweep_steps, configs=(1, 1), needs=lambda job: {"corpus"}, check=_sweep_check,
    resolve=lambda job: f"{len(_sweep_config(job.config_paths[0])['variants'])} variants"))
