"""headscope.evaluate.tables: the fidelity suite's rows as one table (a line per source, chat, NIAH length)."""
from __future__ import annotations

import pandas as pd
import pytest

from headscope.evaluate.tables import fidelity_table


def _row(evaluation, metric, value, family="", context_length=None, phrasing="", status="ok", seed=0):
    return {"evaluation": evaluation, "metric": metric, "value": value, "n": 8, "family": family,
            "context_length": context_length, "phrasing": phrasing, "status": status, "seed": seed}


def _rows(seed=0, shift=0.0):
    r = []
    for src, ratio in (("lodash_code", 1.6), ("devils_dictionary", 1.3)):
        r += [_row("fidelity_text", "perplexity_ratio", ratio + shift, src, 2048, seed=seed),
              _row("fidelity_text", "top1_agreement", 0.7, src, 2048, seed=seed),
              _row("fidelity_continuation", "continuation_agreement", 0.1, src, 256, seed=seed),
              _row("fidelity_continuation", "continuation_agreement_std", 0.2, src, 256, seed=seed)]
    r += [_row("fidelity_chat", "chat_nll_ratio", 1.4, "chat_heldout", seed=seed)]
    for phrasing, s, t in (("pin", 1.0, 1.0), ("plain", 0.5, 0.75)):
        r += [_row("fidelity_niah", "accuracy_student", s, f"{phrasing}+lodash_code", 2040, phrasing, seed=seed),
              _row("fidelity_niah", "accuracy_teacher", t, f"{phrasing}+lodash_code", 2040, phrasing, seed=seed)]
    r += [_row("fidelity_niah", "accuracy_student", None, "pin+x", 4088, "pin", status="skipped", seed=seed)]
    return r


def test_a_line_per_source_chat_and_niah_length():
    t = fidelity_table(pd.DataFrame(_rows()))
    assert list(t.index) == ["lodash_code", "devils_dictionary", "chat_heldout", "niah @2040"]  # skipped rows out
    assert list(t.kind) == ["text", "text", "chat", "niah"]
    assert t.loc["lodash_code", "perplexity_ratio"] == pytest.approx(1.6)
    assert t.loc["devils_dictionary", "continuation_agreement"] == pytest.approx(0.1)
    assert "continuation_agreement_std" not in t.columns  # the headline metrics only
    assert t.loc["chat_heldout", "chat_nll_ratio"] == pytest.approx(1.4)
    niah = t.loc["niah @2040"]  # the mean over phrasings and haystacks
    assert (niah.accuracy_student, niah.accuracy_teacher, niah.accuracy_difference) == pytest.approx((0.75, 0.875,
                                                                                                      -0.125))


def test_seeds_become_an_index_level():
    t = fidelity_table(pd.DataFrame(_rows(0) + _rows(1, shift=0.2)))
    assert t.index.names == ["seed", "source"]
    assert t.loc[(1, "lodash_code"), "perplexity_ratio"] == pytest.approx(1.8)
    ratios = t[t.kind == "text"].groupby(level="source", sort=False).perplexity_ratio.agg(["mean", "std"])
    assert ratios.loc["devils_dictionary", "mean"] == pytest.approx(1.4)


def test_rows_of_another_suite_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="give the rows of the fidelity suite"):
        fidelity_table(pd.DataFrame([_row("niah", "accuracy", 1.0, "", 2040)]))
    with pytest.raises(ValueError, match="no rows with status 'ok'"):
        fidelity_table(pd.DataFrame([_row("fidelity_text", "perplexity_ratio", None, "x", status="skipped")]))
