"""A study's configuration (``StudyConfig``: the TOML of research/studies, validated) and what follows from it
alone: the folder of a variant x seed and the evaluation items in the order they run. The runner that trains and
evaluates the variants is ``research.studies.runner``.

    cfg = StudyConfig.from_file("research/studies/reference.toml", dry_run=False, steps_scale=1.0)
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from headscope.configs import check_fields
from research.studies.variants import VariantSpec

__all__ = ["StudyConfig", "StudyError", "variant_dir", "eval_items", "EVALUATIONS_USED", "SUITES_FILE"]

EVALUATIONS_USED = ("niah", "niah_multikey", "reasoning", "perplexity")
SUITES_FILE = "suites.json"  # in a variant's folder: the suites finished on it, {suite: {seconds_this_call, rows, ok}}
_EVAL_SCALARS = {"timeout_s": 300.0, "token_budget": 65536, "batch_size": 16, "seed": 0,
                 "evaluations": EVALUATIONS_USED}  # which of them run (a study of perplexity alone: ["perplexity"])


class StudyError(ValueError):
    """A study configuration or folder that cannot run (the message names the field or file and the fix)."""


def _merge(base: dict, over: dict) -> dict:
    """Tables merged key by key; anything else (lists of stages included) replaced."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _scale_stages(stages: list[dict], scale: float) -> list[dict]:
    """Every stage's steps (and its warmup / decay steps) times ``scale``, at least 1 step."""
    out = []
    for s in stages:
        s = dict(s)
        steps = max(1, round(s["steps"] * scale))
        for k in ("warmup_steps", "decay_steps"):
            if s.get(k):
                s[k] = min(steps, max(1, round(s[k] * scale)))
        s["steps"] = steps
        out.append(s)
    return out


@dataclass(frozen=True)
class StudyConfig:
    """A study: see the module docstring. ``from_file`` reads the TOML; ``to_dict`` is what ``OUT/study.json``
    holds (resolved: dry-run settings merged, steps scaled)."""

    variants: tuple[VariantSpec, ...]
    train: dict
    teacher: str = "default"
    out: str = "runs/studies"
    seeds: tuple[int, ...] = (0,)
    device: str = "auto"
    parallel: int = 0  # variants in flight at once (0: all)
    threads: int = 1  # torch threads per process
    train_length: int = 0  # the teacher's training length (0: headscope.evaluate.training_length(teacher))
    steps_scale: float = 1.0  # already applied to train.stages; recorded
    dry_run: bool = False
    profile: str = ""  # the [profiles.NAME] table merged in (e.g. "cpu": a CPU-scale replication), "" for none
    profile_note: str = ""  # that table's `note`: what its numbers are (shown above the tables)
    warmup: bool = True  # on CUDA: tune fla's kernels once in the main process before the hybrids' workers start
    scores: dict = field(default_factory=lambda: {"n_samples": 16, "context_length": 1024, "haystack": "heldout"})
    hybrid: dict = field(default_factory=dict)  # HybridOptions shared by every variant
    eval: dict = field(default_factory=dict)
    selector: dict = field(default_factory=dict)  # SelectorConfig fields shared by the "learned" variants
    # headscope.evaluate suites (comma-separated, e.g. "fidelity") run on every trained variant against the teacher
    # after the [eval] items ("": none); the rows go to variants/NAME/seedS/<suite>/ (research.studies.worker)
    suite: str = ""

    def __post_init__(self) -> None:
        vs = tuple(v if isinstance(v, VariantSpec) else VariantSpec.from_dict(v) for v in self.variants)
        object.__setattr__(self, "variants", vs)
        if not vs:
            raise StudyError("study: no [[variants]]; give at least one")
        names = [v.name for v in vs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise StudyError(f"study: variant names {dup} are used twice; each names a folder")
        seeds = tuple(self.seeds)
        if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
            raise StudyError(f"study.seeds={self.seeds!r}: give a list of ints >= 0")
        object.__setattr__(self, "seeds", seeds)
        for v in self.variants:
            extra = sorted(set(v.seeds or ()) - set(seeds))
            if extra:
                raise StudyError(f"variant {v.name!r}: seeds {extra} are not among the study's seeds {list(seeds)}; "
                                 "give a subset (or leave the variant's seeds out: all of them)")
        for k in ("parallel", "threads", "train_length"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise StudyError(f"study.{k}={v!r}: give an int >= 0")
        if not self.steps_scale > 0:
            raise StudyError(f"study.steps_scale={self.steps_scale!r}: must be > 0")
        unknown = sorted(set(self.scores) - {"n_samples", "context_length", "haystack", "sender_rounds"})
        if unknown:
            raise StudyError(f"[scores]: unknown field(s) {unknown}; known: n_samples, context_length, haystack, "
                             "sender_rounds")
        ev = dict(self.eval)
        bad = sorted(k for k in ev if k not in EVALUATIONS_USED and k not in _EVAL_SCALARS)
        if bad:
            raise StudyError(f"[eval]: unknown field(s) {bad}; give tables {list(EVALUATIONS_USED)} and scalars "
                             f"{sorted(_EVAL_SCALARS)}")
        if not isinstance(self.suite, str):
            raise StudyError(f"study.suite={self.suite!r}: give a headscope.evaluate suite name (comma-separated for "
                             "several, e.g. \"fidelity\"), or leave it out")
        from headscope.evaluate.api import resolve_suite

        for name in self.suites:
            try:
                resolve_suite(name)
            except (LookupError, ValueError) as err:
                raise StudyError(f"study.suite: {err}") from None
        chosen = ev.get("evaluations", EVALUATIONS_USED)
        if (not isinstance(chosen, (list, tuple)) or (not chosen and not self.suites)
                or any(not isinstance(e, str) or e not in EVALUATIONS_USED for e in chosen)):
            raise StudyError(f"[eval].evaluations={chosen!r}: give a non-empty list of {list(EVALUATIONS_USED)} "
                             "(empty only with a suite)")
        from headscope.evaluate.registry import make_config

        for name in EVALUATIONS_USED:
            try:
                make_config(name, ev.get(name, {}))
            except (ValueError, TypeError) as err:
                raise StudyError(f"[eval.{name}]: {err}") from None
        for k in ("out", "teacher", "mask", "seed", "hybrid", "device"):
            if k in self.train:
                raise StudyError(f"[train].{k}: set per variant by the study; leave it out of [train]"
                                 + (" (use the top-level field)" if k in ("teacher", "device") else "")
                                 + (" (use the top-level [hybrid] table or a variant's)" if k == "hybrid" else ""))
        self.train_config("check", "mask.json", {}, 0)  # validates [train] and [hybrid] now
        if not isinstance(self.selector, dict):
            raise StudyError(f"[selector]={self.selector!r}: give a table of SelectorConfig fields")
        if self.selector:
            from research.studies.selector import SelectorConfig

            try:
                SelectorConfig.from_dict(self.selector)
            except ValueError as err:
                raise StudyError(f"[selector]: {err}") from None

    # ---- views ---------------------------------------------------------------------------------
    @property
    def suites(self) -> tuple[str, ...]:
        """The suite names of ``suite``, in order."""
        return tuple(x.strip() for x in self.suite.split(",") if x.strip()) if isinstance(self.suite, str) else ()

    def variant(self, name: str) -> VariantSpec:
        for v in self.variants:
            if v.name == name:
                return v
        raise StudyError(f"no variant {name!r} in this study; known: {[v.name for v in self.variants]}")

    def seeds_of(self, spec: VariantSpec) -> tuple[int, ...]:
        seeds = self.seeds if spec.seeds is None else spec.seeds
        return seeds if spec.trains else seeds[:1]  # the teacher is not trained: one evaluation

    def eval_setting(self, key: str):
        return self.eval.get(key, _EVAL_SCALARS[key])

    def train_config(self, out: str, mask: str, options: dict, seed: int):
        """The variant's ``hybrid.train.TrainConfig``."""
        from hybrid.train.config import TrainConfig, TrainConfigError

        try:
            return TrainConfig.from_dict({**self.train, "out": out, "teacher": self.teacher, "mask": mask,
                                          "seed": seed, "device": self.device, "hybrid": options,
                                          "threads": self.train.get("threads", self.threads)})
        except TrainConfigError as err:
            raise StudyError(f"[train]: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["variants"] = [v.to_dict() for v in self.variants]
        d["seeds"] = list(self.seeds)
        return json.loads(json.dumps(d))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StudyConfig":
        check_fields(cls, data, where="study", error=StudyError)
        if "train" not in data or "stages" not in data.get("train", {}):
            raise StudyError("study: no [[train.stages]]; give the shared stage budget")
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path, *, dry_run: bool = False, steps_scale: float = 1.0,
                  profile: str | None = None, **overrides: Any) -> "StudyConfig":
        """Read the TOML; ``dry_run`` merges its ``[dry_run]`` table (``variants`` there: the names to keep);
        ``profile`` merges its ``[profiles.NAME]`` table the same way (``note`` there: what its numbers are;
        ``extra_variants``: variants only the profile has, e.g. a sliding window matched to its shorter length);
        ``steps_scale`` multiplies every stage's steps; ``overrides`` replace top-level fields."""
        import tomllib

        p = Path(path)
        if not p.exists():
            raise StudyError(f"study config {p} does not exist")
        try:
            data = tomllib.loads(p.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise StudyError(f"study config {p} is not valid TOML: {err}") from None
        dry = data.pop("dry_run", {})
        profiles = data.pop("profiles", {})
        overlay, where = None, "[dry_run]"  # the table merged over the study (its variants: the names kept)
        if profile:
            if dry_run:
                raise StudyError("--dry-run and --profile: give one of them")
            if profile not in profiles:
                raise StudyError(f"profile {profile!r}: {p} has no [profiles.{profile}] table; known: "
                                 f"{sorted(profiles) or 'none'}")
            overlay, where = dict(profiles[profile]), f"[profiles.{profile}]"
            data["profile"], data["profile_note"] = profile, str(overlay.pop("note", ""))
        elif dry_run:
            if not dry:
                raise StudyError(f"--dry-run: {p} has no [dry_run] table")
            overlay = dry
        if overlay is not None:
            extra = list(overlay.pop("extra_variants", []))  # variants only the profile has
            keep = overlay.pop("variants", None)
            data = _merge(data, overlay)
            if keep is not None:
                names = [v.get("name") for v in data.get("variants", [])]
                missing = sorted(set(keep) - set(names))
                if missing:
                    raise StudyError(f"{where}.variants: {missing} are not variants of {p}")
                data["variants"] = [v for v in data["variants"] if v.get("name") in keep]
            data["variants"] = list(data.get("variants", [])) + extra
        if not (isinstance(steps_scale, (int, float)) and steps_scale > 0):
            raise StudyError(f"steps_scale={steps_scale!r}: must be > 0 (STEPS_SCALE / --steps-scale)")
        if "train" in data and "stages" in data["train"]:
            data["train"]["stages"] = _scale_stages(data["train"]["stages"], steps_scale)
        data.update(steps_scale=float(steps_scale), dry_run=bool(dry_run), **overrides)
        return cls.from_dict(data)


def variant_dir(out: str | Path, name: str, seed: int) -> Path:
    return Path(out) / "variants" / name / f"seed{seed}"


def eval_items(cfg: StudyConfig, train_length: int) -> list[tuple[str, str, dict]]:
    """(item name, evaluation, config) in the order they run: single-key NIAH at lengths up to the training
    length, multi-key, reasoning, perplexity, then NIAH past the training length (the slowest, last); only the
    evaluations named by ``[eval].evaluations`` (default: all four)."""
    from headscope.evaluate.registry import make_config
    from headscope.evaluate.runtime import ANSWER_ROOM

    def lengths(name: str, room: int) -> tuple[int, ...]:
        c = make_config(name, cfg.eval.get(name, {}))
        if c.lengths:
            return tuple(sorted(set(c.lengths)))
        return tuple(sorted({max(32, int(round(m * train_length)) - room) for m in c.multiples}))

    def over(name: str, **kw) -> dict:
        d = dict(cfg.eval.get(name, {}))
        d.pop("multiples", None)
        d.update(kw)
        return d

    niah = [(f"niah@{L}", "niah", over("niah", lengths=(L,))) for L in lengths("niah", ANSWER_ROOM)]
    short = [x for x in niah if int(x[0].split("@")[1]) <= train_length]
    long = [x for x in niah if x not in short]
    mk = ("niah_multikey", "niah_multikey", over("niah_multikey", lengths=lengths("niah_multikey", ANSWER_ROOM)))
    rs = ("reasoning", "reasoning", dict(cfg.eval.get("reasoning", {})))
    pp = ("perplexity", "perplexity", over("perplexity", lengths=lengths("perplexity", 0)))
    chosen = set(cfg.eval_setting("evaluations"))  # [eval].evaluations: a subset runs, in this order
    return [item for item in short + [mk, rs, pp] + long if item[1] in chosen]
