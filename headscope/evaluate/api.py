"""``evaluate(model, suite)`` -> one long DataFrame of rows; ``summary``; ``compare`` several models.

Every row carries the model's fingerprint, the suite and the seed; ``df.attrs["meta"]`` holds the configs of
every evaluation, the package version, torch/transformers versions and the seconds each evaluation took.
"""
from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd
import torch

from headscope.evaluate.output import read_results
from headscope.evaluate.registry import (UnknownSuiteError, get_evaluation, get_suite, list_evaluations, list_suites,
                                         make_config)
from headscope.evaluate.rows import COLUMNS
from headscope.evaluate.runtime import EvalContext, check_tokenizer, model_info
from headscope.evaluate.tables import SUMMARY_KEYS, summary

__all__ = ["evaluate", "summary", "compare", "load", "load_teacher", "resolve_suite", "plan", "SCHEMA", "RUN_COLUMNS"]

SCHEMA = "headscope.evaluation"
RUN_COLUMNS = ["model", "fingerprint", "suite", "seed"]
_HAYSTACK_FIELD = {"niah": "haystack", "niah_multikey": "haystack", "template_transfer": "haystack",
                   "perplexity": "text"}


def load(spec: str, tokenizer: Any = None, device: str | None = None, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from "default" or a local folder (a hybrid saved with save_pretrained included);
    ``tokenizer``: a tokenizer object, a folder to load one from, or None for the model folder's own."""
    from headscope.loaders import prepare_folder
    from headscope.reference import _resolve, load_model

    src = _resolve(spec)
    prepare_folder(src)  # a model type transformers does not know (a saved hybrid): its package's loader, a check
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if tokenizer is None:
        if Path(src).is_dir() and not any(Path(src).glob("tokenizer*")):
            raise FileNotFoundError(f"no tokenizer in {src}: pass --tokenizer / tokenizer= (the model's own "
                                    "tokenizer; a hybrid uses its teacher's, e.g. --tokenizer default)")
        return load_model(spec, device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, local_files_only=True).to(device).eval()
    if isinstance(tokenizer, (str, Path)):
        tok_src = _resolve(str(tokenizer)) if str(tokenizer) == "default" else str(tokenizer)
        tokenizer = AutoTokenizer.from_pretrained(tok_src, local_files_only=True)
        if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
            tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def load_teacher(spec: str | Path, tokenizer: Any, device: str | None = None, dtype: torch.dtype | None = None):
    """A teacher model from a name or folder (loaded as ``load`` does). A tokenizer saved with it must have the
    vocabulary of ``tokenizer`` (the student's); a folder without one uses ``tokenizer``."""
    from headscope.evaluate.runtime import TokenizerMismatchError

    dtype = dtype or torch.float32
    try:
        teacher, own = load(str(spec), None, device=device, dtype=dtype)
    except FileNotFoundError as err:
        if "no tokenizer" not in str(err):
            raise
        teacher, own = load(str(spec), tokenizer, device=device, dtype=dtype)
    if own is not tokenizer and own.get_vocab() != tokenizer.get_vocab():
        raise TokenizerMismatchError(f"the teacher {str(spec)!r} has another tokenizer than the model: comparing "
                                     "their distributions needs one vocabulary; give the model's own teacher")
    return teacher


def resolve_suite(suite: str | Sequence[str]) -> tuple[str, list[tuple[str, dict]]]:
    """(suite label, [(evaluation, overrides)]) from a suite name, an evaluation name, or a list of names."""
    if isinstance(suite, str):
        if suite in list_suites():
            return suite, [(n, dict(o)) for n, o in get_suite(suite)]
        if suite in list_evaluations():
            return suite, [(suite, {})]
        raise UnknownSuiteError(f"unknown suite {suite!r}; known suites: {', '.join(list_suites())}; "
                                f"known evaluations: {', '.join(list_evaluations())}")
    items = [(get_evaluation(n).name, {}) for n in suite]
    if not items:
        raise UnknownSuiteError(f"no evaluations given; known suites: {', '.join(list_suites())}")
    return "+".join(n for n, _ in items), items


def plan(suite: str | Sequence[str], configs: dict[str, dict[str, Any]] | None = None,
         haystack: str | None = None) -> tuple[str, list[tuple[str, Any]]]:
    """(suite label, [(evaluation, config)]): every name and config checked before any work starts."""
    label, items = resolve_suite(suite)
    configs = dict(configs or {})
    unknown = sorted(set(configs) - {n for n, _ in items})
    if unknown:
        raise ValueError(f"configs for {unknown}, which suite {label!r} does not run ({[n for n, _ in items]})")
    cfgs = []
    for name, over in items:
        over = {**over, **configs.get(name, {})}
        if haystack is not None and name in _HAYSTACK_FIELD:
            over.setdefault(_HAYSTACK_FIELD[name], haystack)
        cfgs.append((name, make_config(name, over)))
    return label, cfgs


def evaluate(model: Any, suite: str | Sequence[str] = "retrieval", tokenizer: Any = None, *, seed: int = 0,
             configs: dict[str, dict[str, Any]] | None = None, haystack: str | None = None,
             batch_size: int | None = None, token_budget: int | None = None, device: str | None = None,
             dtype: torch.dtype | None = None, progress: bool = True, workers: int | None = None,
             budget_s: float | None = None, time_limit_s: float | None = None,
             on_evaluation: Callable[[str, pd.DataFrame], None] | None = None, teacher: Any = None,
             teacher_cache: str | Path | None = None) -> pd.DataFrame:
    """Run ``suite`` (a suite name, one evaluation name, or a list of evaluation names) on ``model``.

    model: a causal LM (a hybrid included) or "default" / a local folder (loaded with its tokenizer).
    tokenizer: the model's; None finds the one saved with the model (``headscope.tokenizers.find_tokenizer``).
    configs: per-evaluation config overrides, ``{"niah": {"n": 4, "lengths": (512,)}}``.
    haystack: a text file (or "heldout" / "train") for every NIAH haystack and the perplexity text.
    workers: spawned processes that build NIAH prompts (default: on a GPU min(8, CPU cores - 1), on a CPU 0); this process builds queued prompts too while it waits.
    budget_s: seconds each evaluation may take; time_limit_s: seconds the whole run may take. What is not reached
      in time is not run: its rows have status "skipped" and a note starting with "budget:". A batch that has
      started finishes, so an evaluation can overrun its budget by one batch.
    on_evaluation: called after each evaluation with its name and the rows so far (e.g. to save partial results).
    progress: progress bars, and a start and a done line with seconds per evaluation and per length (stderr).
    teacher: the model's teacher (a model, or a name/folder loaded like ``model``), for the evaluations that
      compare the model with it (the "fidelity" suite); asking for one of them without a teacher is an error.
      ``df.attrs["meta"]["teacher"]`` describes it; files an evaluation writes (``df.attrs["artifacts"]``, e.g.
      the chat answers side by side) go into the result folder with ``save_results``.
    teacher_cache: a folder that keeps the teacher's side of the fidelity evaluations (its greedy continuations,
      chat answers and their NLL, NIAH accuracy) for the next student compared with the same teacher
      (``headscope.evaluate.teacher_cache``); entries are tied to the teacher's weights, dtype and device type.
    Returns the rows (columns ``RUN_COLUMNS + COLUMNS``); ``df.attrs["meta"]`` describes the run.
    """
    from headscope.evaluate.attention import float32_sdpa_repeats_kv
    from headscope.evaluate.building import default_workers, prompt_builder

    from headscope.evaluate.fidelity import check_teacher

    label, cfgs = plan(suite, configs, haystack)
    need_teacher = check_teacher(cfgs, teacher)
    for name, v in (("budget_s", budget_s), ("time_limit_s", time_limit_s)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ValueError(f"{name}={v!r}: give seconds > 0, or None for no limit")
    if isinstance(model, (str, Path)):
        model, tokenizer = load(str(model), tokenizer, device=device, dtype=dtype or torch.float32)
    elif device is not None or dtype is not None:
        model = model.to(device=device, dtype=dtype)
    from headscope.tokenizers import find_tokenizer

    tokenizer = find_tokenizer(model, tokenizer)  # the one given, or the one saved with the model
    check_tokenizer(model, tokenizer)
    if not need_teacher:
        teacher = None
    elif isinstance(teacher, (str, Path)):
        teacher = load_teacher(teacher, tokenizer, device=device or str(next(model.parameters()).device), dtype=dtype)
    elif device is not None or dtype is not None:
        teacher = teacher.to(device=device, dtype=dtype)
    if teacher is not None:
        check_tokenizer(teacher, tokenizer)
    teacher_training = teacher is not None and teacher.training
    was_training = model.training
    model.eval()
    if teacher is not None:
        teacher.eval()
    cuda = next(model.parameters()).device.type == "cuda"
    cache = None
    if teacher is not None and teacher_cache is not None:
        from headscope.evaluate.teacher_cache import TeacherCache

        cache = TeacherCache(teacher_cache, teacher)
    ctx = EvalContext(seed=seed, batch_size=batch_size or (32 if cuda else 8),
                      token_budget=token_budget or (262144 if cuda else 16384), progress=progress,
                      workers=workers if workers is not None else default_workers(cuda),
                      budget_s=budget_s, artifacts={}, teacher_cache=cache)
    info = model_info(model)
    teacher_info = None if teacher is None else model_info(teacher)
    frames, seconds = [], {}
    start = time.monotonic()
    run_end = None if time_limit_s is None else start + time_limit_s

    def rows_so_far() -> pd.DataFrame:
        df = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
        for col, val in zip(RUN_COLUMNS, (info["model"], info["fingerprint"], label, seed)):
            df.insert(RUN_COLUMNS.index(col), col, val)
        df.attrs["meta"] = run_meta(info, label, seed, ctx, cfgs, seconds)
        if teacher_info is not None:
            df.attrs["meta"]["teacher"] = teacher_info
        if ctx.teacher_cache is not None:
            c = ctx.teacher_cache
            df.attrs["meta"]["teacher_cache"] = {"folder": str(c.folder), "read": c.hits, "computed": c.misses}
        if ctx.artifacts:
            df.attrs["artifacts"] = dict(ctx.artifacts)
        return df

    try:
        with prompt_builder(tokenizer, ctx.workers, activate=True), float32_sdpa_repeats_kv():
            for i, (name, cfg) in enumerate(cfgs):
                t0 = time.monotonic()
                ends = [x for x in (None if budget_s is None else t0 + budget_s, run_end) if x is not None]
                ectx = dataclasses.replace(ctx, deadline=min(ends) if ends else None)
                ctx.log(f"{name}: start (evaluation {i + 1} of {len(cfgs)}, {time.monotonic() - start:.1f} s into "
                        "the run)")
                ev = get_evaluation(name)
                rows = ev.fn(model, tokenizer, cfg, ectx, **({"teacher": teacher} if ev.needs_teacher else {}))
                seconds[name] = round(time.monotonic() - t0, 2)
                frames.append(pd.DataFrame(rows, columns=COLUMNS))
                skipped = sum(1 for r in rows if str(r.get("note") or "").startswith("budget:"))
                ctx.log(f"{name}: done in {seconds[name]:.1f} s ({len(rows)} rows"
                        + (f", {skipped} skipped for the time budget" if skipped else "") + ")")
                if on_evaluation is not None:
                    on_evaluation(name, rows_so_far())
    finally:
        model.train(was_training)
        if teacher is not None:
            teacher.train(teacher_training)
    return rows_so_far()


def run_meta(info: dict, label: str, seed: int, ctx: EvalContext, cfgs, seconds: dict) -> dict[str, Any]:
    import platform

    import transformers

    import headscope

    return {"schema": SCHEMA, "version": headscope.__version__, "suite": label, "seed": seed, **info,
            "context": run_context(ctx),
            "configs": {n: dataclasses.asdict(c) for n, c in cfgs},
            "seconds": seconds, "torch": str(torch.__version__), "transformers": str(transformers.__version__),
            "python": platform.python_version(), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run_context(ctx: EvalContext) -> dict[str, Any]:
    """The run-wide settings of ``ctx`` for ``df.attrs["meta"]["context"]``: plain JSON values only. Not
    ``dataclasses.asdict(ctx)``: that deep-copies every field, and ``teacher_cache`` holds the teacher model (a
    ``TeacherCache``), so the meta held a copy of the teacher's weights (on its device), which pandas deep-copies
    again in every operation on the frame (``DataFrame.__finalize__`` copies ``attrs``): saving a fidelity part took
    seconds. The cache is recorded as its folder (its reads and writes: ``meta["teacher_cache"]``)."""
    out = {}
    for f in dataclasses.fields(ctx):
        if f.name in ("deadline", "artifacts"):
            continue
        v = getattr(ctx, f.name)
        if f.name == "teacher_cache" and v is not None:
            v = str(getattr(v, "folder", v))
        out[f.name] = v
    return out


def _as_frame(result: Any) -> pd.DataFrame:
    if isinstance(result, pd.DataFrame):
        return result
    return read_results(result)


def compare(*results: Any, labels: Sequence[str] | None = None, metrics: Sequence[str] = ("accuracy",)):
    """Several models side by side: ``(table, figure)``. ``results``: DataFrames from ``evaluate`` or result
    folders / results.json paths. The table has one column per model (every summary metric); the figure
    shows ``metrics`` (default the generation accuracies) as grouped bars."""
    if len(results) == 1 and isinstance(results[0], (list, tuple)):
        results = tuple(results[0])
    if not results:
        raise ValueError("compare: give at least one result")
    frames = [_as_frame(r) for r in results]
    if labels is None:
        labels = [str(f["model"].iloc[0]) if "model" in f and len(f) else f"model {i}" for i, f in enumerate(frames)]
        labels = [Path(x).name or x for x in labels]
        if len(set(labels)) < len(labels):
            labels = [f"{x} ({i})" for i, x in enumerate(labels)]
    if len(labels) != len(frames):
        raise ValueError(f"compare: {len(labels)} labels for {len(frames)} results")
    parts = []
    for lab, f in zip(labels, frames):
        s = summary(f)
        s["model"] = lab
        parts.append(s)
    long = pd.concat(parts, ignore_index=True)
    keys = [k for k in SUMMARY_KEYS if k in long.columns]
    table = long.pivot_table(index=keys, columns="model", values="value", aggfunc="mean", sort=False)
    table = table[list(labels)]
    from headscope.evaluate.figures import compare_plot

    sel = table[table.index.get_level_values("metric").isin(list(metrics))]
    fig = compare_plot(sel if len(sel) else table, title="evaluation side by side: " + ", ".join(labels))
    return table, fig
