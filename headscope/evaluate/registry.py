"""Named evaluations and named suites.

An evaluation is ``fn(model, tokenizer, config, ctx) -> list[dict]`` (rows) with a frozen config dataclass;
a suite is an ordered list of (evaluation name, config overrides). A new evaluation is one
``register_evaluation`` call and a test; a new suite one ``register_suite`` call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["Evaluation", "UnknownEvaluationError", "UnknownSuiteError", "register_evaluation", "get_evaluation",
           "list_evaluations", "register_suite", "get_suite", "list_suites", "make_config"]


class UnknownEvaluationError(LookupError):
    """An evaluation name that is not registered."""


class UnknownSuiteError(LookupError):
    """A suite name that is not registered."""


@dataclass(frozen=True)
class Evaluation:
    name: str
    fn: Callable[..., list[dict]]  # fn(model, tokenizer, config, ctx) -> rows
    Config: type  # a frozen dataclass
    description: str = ""


_EVALUATIONS: dict[str, Evaluation] = {}
_SUITES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {}


def register_evaluation(name: str, fn: Callable[..., list[dict]], Config: type, description: str = "") -> None:
    """Register ``fn`` under ``name`` (re-registering replaces it)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"evaluation name {name!r}: give a non-empty string")
    if not callable(fn):
        raise ValueError(f"evaluation {name!r}: fn={fn!r} is not callable")
    if not (dataclasses.is_dataclass(Config) and Config.__dataclass_params__.frozen):
        raise ValueError(f"evaluation {name!r}: Config must be a frozen dataclass, got {Config!r}")
    _EVALUATIONS[name] = Evaluation(name, fn, Config, description)


def list_evaluations() -> list[str]:
    return sorted(_EVALUATIONS)


def get_evaluation(name: str) -> Evaluation:
    if name not in _EVALUATIONS:
        raise UnknownEvaluationError(f"unknown evaluation {name!r}; known evaluations: {', '.join(list_evaluations())}")
    return _EVALUATIONS[name]


def make_config(name: str, overrides: dict[str, Any] | None = None):
    """The config of evaluation ``name`` with ``overrides``; an unknown field is a ValueError naming it."""
    ev = get_evaluation(name)
    overrides = dict(overrides or {})
    fields = [f.name for f in dataclasses.fields(ev.Config)]
    unknown = sorted(k for k in overrides if k not in fields)
    if unknown:
        raise ValueError(f"evaluation {name!r} has no config field(s) {unknown}; its fields: {fields}")
    for f in dataclasses.fields(ev.Config):  # lists from JSON / the command line become tuples
        if isinstance(overrides.get(f.name), list):
            overrides[f.name] = tuple(overrides[f.name])
    return ev.Config(**overrides)


def register_suite(name: str, evaluations: list[tuple[str, dict[str, Any]] | str]) -> None:
    """A named, ordered list of evaluations, each a name or (name, config overrides)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"suite name {name!r}: give a non-empty string")
    items = []
    for item in evaluations:
        ev, over = (item, {}) if isinstance(item, str) else item
        make_config(ev, over)  # validates the name and the fields now, not at run time
        items.append((ev, dict(over)))
    if not items:
        raise ValueError(f"suite {name!r} has no evaluations")
    _SUITES[name] = tuple(items)


def list_suites() -> list[str]:
    return sorted(_SUITES)


def get_suite(name: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    if name not in _SUITES:
        raise UnknownSuiteError(f"unknown suite {name!r}; known suites: {', '.join(list_suites())} "
                                f"(or pass evaluation names: {', '.join(list_evaluations())})")
    return _SUITES[name]
