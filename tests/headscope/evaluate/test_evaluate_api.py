"""headscope.evaluate on tiny models: registry, rows and columns, determinism, figures, clean stops, bad inputs,
a hybrid from hybrid.from_mask through every evaluation."""
import math

import pandas as pd
import pytest
import torch

import headscope
from headscope.evaluate import (TokenizerMismatchError, UnknownEvaluationError, UnknownSuiteError, compare,
                                get_evaluation, list_evaluations, list_suites, register_evaluation, summary)
from headscope.evaluate.api import RUN_COLUMNS
from headscope.evaluate.rows import COLUMNS
from headscope.mask import config_fingerprint

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

EVALS = ["cost", "niah", "niah_multikey", "perplexity", "reasoning", "template_transfer"]
# settings that fit a 128-token character tokenizer and a 256-position tiny model
TINY = {
    "niah": {"lengths": (160, 200), "n": 1},
    "niah_multikey": {"lengths": (200,), "n_keys": (2, 8), "n": 2},
    "template_transfer": {"lengths": (200,), "n": 2},
    "reasoning": {"sizes": (("binding", (2, 3)),), "n": 3},
    "perplexity": {"lengths": (32, 64), "n_windows": 2, "bins": 4},
    "cost": {"lengths": (32, 64), "repeats": 1, "decode_context": 32, "decode_tokens": 2},
}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def teacher_df(teacher, tok):
    return headscope.evaluate(teacher, "default", tok, configs=TINY, progress=False)


def test_headscope_evaluate_is_the_package_and_callable():
    import sys

    assert headscope.evaluate is sys.modules["headscope.evaluate"] and callable(headscope.evaluate)


def test_registry_lists_and_extends():
    assert sorted(list_evaluations()) == EVALS or set(EVALS) <= set(list_evaluations())
    assert {"smoke", "retrieval", "reasoning", "default", "full"} <= set(list_suites())
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        value: float = 0.5

    register_evaluation("constant_test", lambda m, t, c, ctx: [
        __import__("headscope.evaluate.rows", fromlist=["row"]).row("constant_test", "value", c.value, 1)], Cfg)
    df = headscope.evaluate(tiny_model("qwen3"), "constant_test", char_tokenizer(), configs={
        "constant_test": {"value": 0.25}}, progress=False)
    assert df.value.tolist() == [0.25] and get_evaluation("constant_test").Config is Cfg


def test_columns_and_run_metadata(teacher_df, teacher):
    assert list(teacher_df.columns) == RUN_COLUMNS + COLUMNS
    assert set(teacher_df.evaluation) == set(EVALS)
    assert (teacher_df.fingerprint == config_fingerprint(teacher)).all()
    meta = teacher_df.attrs["meta"]
    assert meta["schema"] == "headscope.evaluation" and meta["version"] == headscope.__version__
    assert meta["configs"]["niah"]["lengths"] == (160, 200) and meta["seed"] == 0
    assert set(meta["seconds"]) == set(EVALS)
    niah = teacher_df[teacher_df.evaluation == "niah"]
    acc = niah[niah.metric == "accuracy"]
    assert len(acc) == 2 * 11 and sorted(acc.depth.unique()) == pytest.approx([i / 10 for i in range(11)])
    assert ((acc.value >= 0) & (acc.value <= 1)).all()
    assert set(niah.metric) >= {"accuracy", "accuracy_teacher_forced"}
    ppl = teacher_df[(teacher_df.evaluation == "perplexity") & (teacher_df.metric == "perplexity")]
    assert ppl.context_length.tolist() == [32, 64] and (ppl.value > 1).all()
    loss = teacher_df[teacher_df.metric == "loss"]
    assert loss.groupby("context_length").position.max().tolist() == [32, 64]
    cost = teacher_df[teacher_df.evaluation == "cost"].set_index("metric")
    assert cost.loc["cache_bytes", "value"] > 0 and cost.loc["decode_seconds_per_token", "value"] > 0
    assert (cost.loc["prefill_seconds", "value"] > 0).all()
    tt = teacher_df[(teacher_df.evaluation == "template_transfer") & (teacher_df.metric == "accuracy")]
    assert set(tt.phrasing) == {"trained", "code", "pin", "plain"} and set(tt.family) == {"trained", "transfer"}
    reasoning = teacher_df[(teacher_df.evaluation == "reasoning") & (teacher_df.metric == "accuracy")]
    assert reasoning[reasoning.family == "binding"]["size"].tolist() == [2, 3]
    assert reasoning[reasoning.family == "arithmetic"]["size"].isna().all()  # no sizes given: its default


def test_clean_stop_when_the_needles_do_not_fit(teacher_df):
    mk = teacher_df[teacher_df.evaluation == "niah_multikey"]
    eight = mk[mk.n_keys == 8]
    assert (eight.status == "skipped").all() and eight.value.isna().all()
    assert eight.note.str.contains("needles and question alone").all()
    assert (mk[mk.n_keys == 2].status == "ok").all()


def test_positions_end_gives_rows_that_say_so(tok):
    gpt2 = tiny_model("gpt2")
    gpt2.config.eos_token_id = tok.eos_token_id
    df = headscope.evaluate(gpt2, "niah", tok, configs={"niah": {"lengths": (160, 400), "depths": (0.5,), "n": 1}},
                            progress=False)
    long = df[df.context_length == 400]
    assert (long.status == "skipped").all() and long.note.str.contains("256 learned positions").all()
    assert (df[df.context_length == 160].status == "ok").all()
    assert headscope.evaluate.position_limit(gpt2) == 256 and headscope.evaluate.position_limit(tiny_model()) is None


def test_same_seed_same_rows(teacher, tok, teacher_df):
    cfg = {k: v for k, v in TINY.items() if k != "cost"}
    suite = ["niah", "niah_multikey", "template_transfer", "reasoning", "perplexity"]  # the default order
    again = headscope.evaluate(teacher, suite, tok, configs=cfg, progress=False)
    first = teacher_df[teacher_df.evaluation != "cost"].drop(columns=["suite"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(first, again.drop(columns=["suite"]).reset_index(drop=True))


def test_heatmap_axes(teacher_df):
    from headscope.evaluate.figures import figures_for, niah_heatmap

    fig = niah_heatmap(teacher_df)
    assert fig.layout.xaxis.title.text == "context length (tokens)"
    assert fig.layout.yaxis.title.text.startswith("needle depth")
    hm = fig.data[0]
    assert list(hm.x) == ["160", "200"] and len(hm.y) == 11 and hm.z.shape == (11, 2)
    assert set(figures_for(teacher_df)) == {"niah_heatmap", "niah_lines", "multikey", "loss_by_position"}


def test_summary_and_compare(teacher_df):
    s = summary(teacher_df)
    niah = s[(s.evaluation == "niah") & (s.metric == "accuracy")]
    assert len(niah) == 2 and niah.n.tolist() == [11, 11]
    table, fig = compare(teacher_df, teacher_df, labels=["teacher", "again"])
    assert list(table.columns) == ["teacher", "again"]
    assert (table["teacher"].fillna(-1) == table["again"].fillna(-1)).all()
    assert len(fig.data) == 2


@pytest.mark.parametrize("suite,err,names", [("nope", UnknownSuiteError, "smoke"),
                                             (["niah", "nope"], UnknownEvaluationError, "template_transfer")])
def test_unknown_names_list_the_known_ones(teacher, tok, suite, err, names):
    with pytest.raises(err, match=names):
        headscope.evaluate(teacher, suite, tok, progress=False)


def test_bad_config_field_and_value(teacher, tok):
    with pytest.raises(ValueError, match="no config field.*'depht'"):
        headscope.evaluate(teacher, "niah", tok, configs={"niah": {"depht": 0.5}})
    with pytest.raises(ValueError, match="depths="):
        headscope.evaluate(teacher, "niah", tok, configs={"niah": {"depths": (1.5,)}})
    with pytest.raises(ValueError, match="does not run"):
        headscope.evaluate(teacher, "reasoning", tok, configs={"niah": {"n": 1}})


def test_tokenizer_that_does_not_match(teacher):
    with pytest.raises(TokenizerMismatchError, match="200 tokens but the model's embedding has 128"):
        headscope.evaluate(teacher, "niah", char_tokenizer(200))
    m = tiny_model("qwen3")
    m.config.eos_token_id = 5
    with pytest.raises(TokenizerMismatchError, match="end-of-text id"):
        headscope.evaluate(m, "niah", char_tokenizer())


def test_bf16_runs(tok):
    m = tiny_model("qwen3", dtype=torch.bfloat16)
    df = headscope.evaluate(m, ["niah", "perplexity"], tok, configs={
        "niah": {"lengths": (200,), "depths": (0.0, 1.0), "n": 1}, "perplexity": {"lengths": (32,), "n_windows": 1}},
        progress=False)
    assert (df.status == "ok").all() and df.attrs["meta"]["dtype"] == "bfloat16"
    assert math.isfinite(df[df.metric == "perplexity"].value.iloc[0])


def test_hybrid_through_every_evaluation(teacher, tok, teacher_df, tmp_path):
    import hybrid
    from headscope.mask import HeadMask

    model = hybrid.from_mask(teacher, HeadMask.for_model(teacher, [(0, 1), (1, 0), (2, 2)]))
    df = headscope.evaluate(model, "default", tok, configs=TINY, progress=False)
    assert set(df.evaluation) == set(EVALS)
    ok = df[df.status == "ok"]
    assert set(ok.evaluation) == set(EVALS)
    bad = df[df.status != "ok"]  # only the 8-key prompts that do not fit, and peak memory (CUDA only)
    assert ((bad.n_keys == 8) | (bad.metric == "peak_memory_bytes")).all()
    assert df.fingerprint.iloc[0] == config_fingerprint(model) != teacher_df.fingerprint.iloc[0]
    cache = df[(df.evaluation == "cost") & (df.metric == "cache_bytes")].value.iloc[0]
    assert cache > 0
    # saved with save_pretrained and loaded back by path: the same rows
    model.save_pretrained(tmp_path / "hyb")
    again = headscope.evaluate(str(tmp_path / "hyb"), ["niah", "reasoning"], tok,
                               configs={k: TINY[k] for k in ("niah", "reasoning")}, progress=False)
    mine = df[df.evaluation.isin(["niah", "reasoning"])].drop(columns=["model", "suite"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(mine, again.drop(columns=["model", "suite"]).reset_index(drop=True),
                                  check_dtype=False)


def test_prompts_built_in_worker_processes_are_the_same(teacher, tok):
    cfg = {"niah": {"lengths": (160,), "depths": (0.0, 0.5, 1.0), "n": 2}}
    a = headscope.evaluate(teacher, "niah", tok, configs=cfg, progress=False, workers=0)
    b = headscope.evaluate(teacher, "niah", tok, configs=cfg, progress=False, workers=2)
    pd.testing.assert_frame_equal(a, b)


def _oom_when(pred):
    """headscope.evaluate.measures.window_losses that runs out of memory whenever ``pred(ctx)`` holds."""
    from headscope.evaluate import engine

    def losses(model, windows, ctx, desc="loss"):
        if pred(ctx):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")
        return engine.window_losses(model, windows, ctx, desc=desc)
    return losses


def test_perplexity_out_of_memory_tries_one_window_at_a_time_then_stops_cleanly(teacher, tok, monkeypatch):
    cfg = {"perplexity": {"lengths": (32, 64), "n_windows": 2, "bins": 4}}
    clean = headscope.evaluate(teacher, "perplexity", tok, configs=cfg, progress=False)
    monkeypatch.setattr("headscope.evaluate.measures.window_losses", _oom_when(lambda ctx: ctx.batch_size > 1))
    again = headscope.evaluate(teacher, "perplexity", tok, configs=cfg, progress=False)  # measured one at a time
    pd.testing.assert_frame_equal(clean[clean.metric == "perplexity"].reset_index(drop=True),
                                  again[again.metric == "perplexity"].reset_index(drop=True), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr("headscope.evaluate.measures.window_losses", _oom_when(lambda ctx: True))
    df = headscope.evaluate(teacher, "perplexity", tok, configs=cfg, progress=False)
    ppl = df[df.metric == "perplexity"]
    assert list(ppl.status) == ["stopped", "stopped"] and ppl.value.isna().all()
    assert "out of memory at 32 tokens" in ppl.note.iloc[0] and "longer lengths not tried" in ppl.note.iloc[0]


def test_reasoning_forms_reach_the_tasks_and_default_to_the_registry_forms(teacher, tok, monkeypatch):
    import headscope.tasks
    from headscope.evaluate.measures import ReasoningEvalConfig

    seen = []
    real = headscope.tasks.get_task

    def spy(name, **kw):
        seen.append((name, kw))
        return real(name, **kw)

    monkeypatch.setattr(headscope.tasks, "get_task", spy)
    cfg = {"reasoning": {"sizes": (("binding", (2,)),), "families": ("binding",), "n": 2,
                         "forms": {"binding": {"chain": 0.0}}}}
    df = headscope.evaluate(teacher, "reasoning", tok, configs=cfg, progress=False)
    assert (df.status == "ok").all() and seen == [("binding", {"chain": 0.0, "n_vars": 2})]
    seen.clear()  # no forms given: a registry model's own (none for this tiny model: the plain form)
    headscope.evaluate(teacher, "reasoning", tok, configs={"reasoning": {**cfg["reasoning"], "forms": None}},
                       progress=False)
    assert seen == [("binding", {"n_vars": 2})]
    with pytest.raises(ValueError, match="forms=.*family names"):
        ReasoningEvalConfig(forms={"bindng": {}})


def test_out_of_memory_halves_the_rows_per_forward_until_it_fits(capsys):
    from headscope.evaluate.runtime import EvalContext, fewer_rows_after_oom

    tried = []

    def call(c, fits=8):
        tried.append(c.rows_per_batch(100))
        if c.rows_per_batch(100) > fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 24.00 GiB")
        return "scores"

    ctx = EvalContext(batch_size=32, token_budget=10**9)
    assert fewer_rows_after_oom(call, ctx, 100, torch.device("cpu")) == "scores"
    assert tried == [32, 16, 8]  # not straight to one row per forward (8186-token NIAH: 102 s instead of ~20 s)
    err = capsys.readouterr().err
    assert "out of memory with 32 rows of 100 tokens per forward; again with 16" in err and "again with 8" in err
    tried.clear()
    with pytest.raises(torch.OutOfMemoryError):  # one row still too many: the caller's to report
        fewer_rows_after_oom(lambda c: call(c, fits=0), EvalContext(batch_size=3), 100, torch.device("cpu"))
    assert tried == [3, 1]
