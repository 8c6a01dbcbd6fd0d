"""Bounded wall time and visible progress: per-evaluation time budgets (what is not reached becomes "skipped"
rows with a "budget:" note, never missing rows), a start and a done line per evaluation and length, and the
``on_evaluation`` callback that lets a caller save partial results."""
import time

import pytest

import headscope
from headscope.evaluate.runtime import BudgetExceeded, EvalContext
from headscope.hooks import hooks, post

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

EVALS = ["niah", "niah_multikey", "template_transfer", "reasoning", "perplexity", "cost"]
TINY = {
    "niah": {"lengths": (160, 200), "depths": (0.0, 1.0), "n": 1},
    "niah_multikey": {"lengths": (200, 240), "n_keys": (2,), "n": 1},
    "template_transfer": {"lengths": (200, 240), "phrasings": ("trained", "code"), "n": 1},
    "reasoning": {"families": ("binding", "comparison"), "sizes": (), "n": 2},
    "perplexity": {"lengths": (32, 64), "n_windows": 2, "bins": 4},
    "cost": {"lengths": (32, 64), "repeats": 1, "decode_context": 32, "decode_tokens": 2},
}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.fixture
def clock(monkeypatch):
    """time.monotonic under the test's control: ``clock[0]`` seconds; the budget checks read it."""
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    return now


def cells(df) -> set:
    """The (evaluation, metric, length, depth, keys, family, phrasing) cells; a reasoning row's length is its
    mean prompt length (unknown when skipped), per-position losses and the unseen-values count depend on what ran."""
    d = df[~df.metric.isin(["loss", "accuracy_unseen_values"])].copy()
    d.loc[d.evaluation == "reasoning", "context_length"] = None
    key = ["evaluation", "metric", "context_length", "depth", "n_keys", "family", "phrasing"]
    return set(map(tuple, d[key].astype(str).values))


def _budget_rows(df):
    return df[df.note.fillna("").astype(str).str.startswith("budget:")]


def test_spent_budget_gives_skipped_rows_for_every_evaluation(model, tok, clock):
    full = headscope.evaluate(model, EVALS, tok, configs=TINY, progress=False)

    def tick(module, args, out):  # every forward takes 10 "seconds"; a 5-second budget ends after the first
        clock[0] += 10

    with hooks(post(model, tick)):
        df = headscope.evaluate(model, EVALS, tok, configs=TINY, progress=False, budget_s=5)
    assert set(df.evaluation) == set(EVALS)
    skipped = _budget_rows(df)
    assert (skipped.status == "skipped").all() and skipped.value.isna().all()
    assert set(skipped.evaluation) == set(EVALS)  # each evaluation stopped after its first forward
    assert cells(df) == cells(full)  # nothing missing: the cells of an unbounded run, the unreached ones marked
    niah = df[df.evaluation == "niah"]
    assert (niah[niah.context_length == 200].note.str.startswith("budget:")).all()  # the longer length
    assert (niah[niah.context_length == 160].status == "ok").all()  # the first one finished its batch


def test_budget_spent_between_batches_skips_that_length(model, tok, clock):
    from headscope.evaluate import get_evaluation
    from headscope.evaluate.registry import make_config

    cfg = make_config("niah", {"lengths": (160,), "depths": (0.0, 0.5, 1.0), "n": 2})
    ctx = EvalContext(batch_size=2, progress=False, deadline=1005.0)

    def tick(module, args, out):
        clock[0] += 10

    with hooks(post(model, tick)):
        rows = get_evaluation("niah").fn(model, tok, cfg, ctx)
    assert {r["status"] for r in rows} == {"skipped"}  # batch 1 ran, batch 2 found the budget spent
    assert all(r["note"].startswith("budget:") and "niah at 160 tokens" in r["note"] for r in rows)


def test_no_budget_runs_everything(model, tok):
    df = headscope.evaluate(model, EVALS, tok, configs=TINY, progress=False)
    assert _budget_rows(df).empty
    assert df.attrs["meta"]["context"]["budget_s"] is None and "deadline" not in df.attrs["meta"]["context"]


def test_run_time_limit_skips_later_evaluations(model, tok, clock):
    def tick(module, args, out):
        clock[0] += 10

    with hooks(post(model, tick)):
        df = headscope.evaluate(model, ["perplexity", "reasoning"], tok, progress=False, time_limit_s=5,
                                configs={k: TINY[k] for k in ("perplexity", "reasoning")})
    ppl, reas = df[df.evaluation == "perplexity"], df[df.evaluation == "reasoning"]
    assert (ppl[ppl.context_length == 32].status == "ok").all()
    assert _budget_rows(ppl).context_length.tolist() == [64]
    assert len(reas) and (reas.status == "skipped").all() and reas.note.str.contains("time limit").all()


def test_check_budget_raises():
    EvalContext(deadline=None).check_budget("x")  # no deadline: never
    with pytest.raises(BudgetExceeded, match="budget: .*during niah @160"):
        EvalContext(deadline=0.0).check_budget("niah @160")


@pytest.mark.parametrize("kw", [{"budget_s": -1}, {"budget_s": True}, {"deadline": "soon"}])
def test_bad_budget_in_context(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        EvalContext(**kw)


@pytest.mark.parametrize("kw", [{"budget_s": 0}, {"time_limit_s": -3}, {"budget_s": "60"}])
def test_bad_budget_in_evaluate(model, tok, kw):
    with pytest.raises(ValueError, match=next(iter(kw)) + ".*give seconds"):
        headscope.evaluate(model, "niah", tok, configs={"niah": TINY["niah"]}, progress=False, **kw)


def test_progress_lines_and_partial_results(model, tok, capsys):
    seen = []
    df = headscope.evaluate(model, ["niah", "perplexity", "cost"], tok, progress=True,
                            configs={k: TINY[k] for k in ("niah", "perplexity", "cost")},
                            on_evaluation=lambda name, rows: seen.append((name, len(rows),
                                                                          sorted(set(rows.evaluation)))))
    err = capsys.readouterr().err
    for line in ("niah: start (evaluation 1 of 3", "niah @160: start", "niah @160: done in", "niah @200: done in",
                 "niah: done in", "perplexity @64: start", "perplexity @64: done in", "cost @32: done in",
                 "cost decode @32: done in", "cost: done in"):
        assert line in err, line
    assert [s[0] for s in seen] == ["niah", "perplexity", "cost"]
    assert seen[0][2] == ["niah"] and seen[1][2] == ["niah", "perplexity"] and seen[2][1] == len(df)


def test_quiet_prints_nothing(model, tok, capsys):
    headscope.evaluate(model, "niah", tok, configs={"niah": TINY["niah"]}, progress=False)
    assert "[eval" not in capsys.readouterr().err
