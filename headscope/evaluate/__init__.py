"""One evaluation harness for teachers and hybrids: retrieval by length and depth, reasoning, perplexity, cost.

    import headscope
    df = headscope.evaluate(model, suite="retrieval", tokenizer=tok)      # a long DataFrame of rows
    headscope.evaluate.summary(df)                                        # headline numbers
    table, fig = headscope.evaluate.compare(teacher_df, hybrid_df)        # side by side
    headscope.evaluate.list_suites(); headscope.evaluate.list_evaluations()

``headscope.evaluate`` is this package and is also callable (``headscope.evaluate(...)`` is
``headscope.evaluate.evaluate(...)``). Command line: ``headscope eval --model default --suite smoke --out DIR``.
"""
from __future__ import annotations

import sys
import types

from headscope.evaluate import suites as _suites  # noqa: F401  (registers the evaluations and suites)
from headscope.evaluate.api import compare, evaluate, load, summary
from headscope.evaluate.output import read_results, save_results
from headscope.evaluate.registry import (Evaluation, UnknownEvaluationError, UnknownSuiteError, get_evaluation,
                                         get_suite, list_evaluations, list_suites, register_evaluation,
                                         register_suite)
from headscope.evaluate.runtime import EvalContext, TokenizerMismatchError, position_limit, training_length

__all__ = ["evaluate", "summary", "compare", "load", "save_results", "read_results", "Evaluation",
           "UnknownEvaluationError", "UnknownSuiteError", "TokenizerMismatchError", "EvalContext",
           "register_evaluation", "register_suite", "get_evaluation", "get_suite", "list_evaluations",
           "list_suites", "training_length", "position_limit"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return evaluate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
