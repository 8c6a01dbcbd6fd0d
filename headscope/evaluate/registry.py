"""Named evaluations and named suites.

An evaluation is ``fn(model, tokenizer, config, ctx) -> list[dict]`` (rows) with a frozen config dataclass;
a suite is an ordered list of (evaluation name, config overrides). A new evaluation is one
``register_evaluation`` call and a test; a new suite one ``register_suite`` call.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from headscope.configs import from_dict
from headscope.registry import Registry

__all__ = ["Evaluation", "UnknownEvaluationError", "UnknownSuiteError", "register_evaluation", "get_evaluation",
           "list_evaluations", "register_suite", "get_suite", "list_suites", "make_config", "EVALUATIONS", "SUITES"]


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
    needs_teacher: bool = False  # True: also called with teacher=<the teacher model> (evaluate(teacher=...))


EVALUATIONS: Registry[Evaluation] = Registry("evaluation", owner="headscope.evaluate.registry.EVALUATIONS")
SUITES: Registry[tuple[tuple[str, dict[str, Any]], ...]] = Registry("suite",
                                                                    owner="headscope.evaluate.registry.SUITES")


def register_evaluation(name: str, fn: Callable[..., list[dict]], Config: type, description: str = "", *,
                        overwrite: bool = False, needs_teacher: bool = False) -> None:
    """Register ``fn`` under ``name``; a taken name (a built-in included) needs ``overwrite=True``.
    ``needs_teacher``: ``fn`` compares the model with a teacher and is called as
    ``fn(model, tokenizer, config, ctx, teacher=teacher)``; running it without a teacher is an error."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"evaluation name {name!r}: give a non-empty string")
    if not callable(fn):
        raise ValueError(f"evaluation {name!r}: fn={fn!r} is not callable")
    if not (dataclasses.is_dataclass(Config) and Config.__dataclass_params__.frozen):
        raise ValueError(f"evaluation {name!r}: Config must be a frozen dataclass, got {Config!r}")
    EVALUATIONS.register(name, Evaluation(name, fn, Config, description, bool(needs_teacher)), overwrite=overwrite)


def list_evaluations() -> list[str]:
    return sorted(EVALUATIONS)


def get_evaluation(name: str) -> Evaluation:
    if name not in EVALUATIONS:
        raise UnknownEvaluationError(f"unknown evaluation {name!r}; known evaluations: {', '.join(list_evaluations())}")
    return EVALUATIONS[name]


def make_config(name: str, overrides: dict[str, Any] | None = None):
    """The config of evaluation ``name`` with ``overrides``; an unknown field is a ValueError naming it."""
    ev = get_evaluation(name)
    # lists from JSON / the command line become tuples
    return from_dict(ev.Config, dict(overrides or {}), where=f"evaluation {name!r}",
                     unknown_text="no config field(s)", tuples=True)


def register_suite(name: str, evaluations: list[tuple[str, dict[str, Any]] | str], *,
                   overwrite: bool = False) -> None:
    """A named, ordered list of evaluations, each a name or (name, config overrides); a taken name needs
    ``overwrite=True``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"suite name {name!r}: give a non-empty string")
    items = []
    for item in evaluations:
        ev, over = (item, {}) if isinstance(item, str) else item
        make_config(ev, over)  # validates the name and the fields now, not at run time
        items.append((ev, dict(over)))
    if not items:
        raise ValueError(f"suite {name!r} has no evaluations")
    SUITES.register(name, tuple(items), overwrite=overwrite)


def list_suites() -> list[str]:
    return sorted(SUITES)


def get_suite(name: str) -> tuple[tuple[str, dict[str, Any]], ...]:
    if name not in SUITES:
        raise UnknownSuiteError(f"unknown suite {name!r}; known suites: {', '.join(list_suites())} "
                                f"(or pass evaluation names: {', '.join(list_evaluations())})")
    return SUITES[name]
