"""Knockout curves and single head-set knockouts on a tiny model."""
import random

import pandas as pd
import pytest
import torch

from headscope.heads import Head
from headscope.knockout import auc, default_ks, knockout_curve, knockout_eval
from headscope.results import HeadScores

from char_tokenizer import word_tokenizer
from model_factories import tiny_model


@pytest.fixture(scope="module")
def pairs():
    from headscope.tasks import from_pairs

    rng = random.Random(1)
    items = []
    for i in range(6):
        a, b = rng.sample(range(10), 2)
        pad = "a b " * (i % 3)  # different lengths: exercises padding
        items.append((f"{pad}the number is {a} c the answer is", f"{pad}the number is {b} c the answer is",
                      f" {a}", f" {b}"))
    return from_pairs("toy", items).tokenized(word_tokenizer())


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


@pytest.mark.parametrize("kind", ["mean", "zero", "patch"])
def test_curve_rows_and_consistency(model, pairs, kind):
    scores = HeadScores("toy", torch.rand(4, 3, 4, generator=torch.Generator().manual_seed(0)))
    df = knockout_curve(model, pairs, scores, ks=[0, 2, 4], kind=kind, n_random=2, batch_size=4,
                        progress=False)
    assert list(df.columns) == ["k", "fraction", "selection", "seed", "accuracy", "metric"]
    assert len(df[df.selection == "top"]) == 3 and len(df[df.selection == "random"]) == 3 * 2
    k0 = df[df.k == 0]
    assert k0.metric.nunique() == 1 and k0.accuracy.nunique() == 1  # the intact model everywhere
    # the top-4 row is exactly knockout_eval of the 4 best heads (batching and padding do not matter)
    top4 = scores.top(4)
    one = knockout_eval(model, pairs, top4, kind=kind, batch_size=1)
    row = df[(df.selection == "top") & (df.k == 4)].iloc[0]
    assert row.metric == pytest.approx(one["metric"], abs=1e-5) and row.accuracy == one["accuracy"]
    assert one["metric_clean"] == pytest.approx(float(k0.metric.iloc[0]), abs=1e-5)
    if kind != "zero":
        assert row.metric != pytest.approx(one["metric_clean"], abs=1e-9)  # knocking heads out changes the run


def test_patch_knockout_of_a_head_equals_patching_it(model, pairs):
    """'patch' with one head = the activation-patching run behind that head's receiver score."""
    from headscope.ablation import ablate_heads
    from headscope.arch import describe
    from headscope.hooks import record_inputs

    p = pairs[0]
    with torch.no_grad(), record_inputs(describe(model).out_projs) as store:
        model(input_ids=p.corrupt_ids[None])
    with torch.no_grad(), ablate_heads(model, [Head(1, 3)], kind="patch", values={Head(1, 3): store[1][..., 48:64]}):
        at = model(input_ids=p.clean_ids[None]).logits[0, p.answer_pos]
    want = float((at[:, p.clean_answer_ids] - at[:, p.corrupt_answer_ids]).diagonal().mean())
    got = knockout_eval(model, pairs[:1], [Head(1, 3)], kind="patch")["metric"]
    assert got == pytest.approx(want, abs=1e-5)
    assert knockout_eval(model, pairs[:1], [Head(1, 3)])["metric"] == got  # "patch" is the default (the paper's)


def test_default_ks_and_errors(model, pairs):
    ks = default_ks(448)  # 10% of 448 heads = 45
    assert ks[0] == 0 and ks[-1] == 45 and len(ks) == 11 and ks == sorted(set(ks))
    assert default_ks(12) == [0, 1]
    with pytest.raises(ValueError, match="kind"):
        knockout_curve(model, pairs, torch.rand(3, 4), kind="noise")
    with pytest.raises(ValueError, match="score this model"):
        knockout_curve(model, pairs, torch.rand(2, 4))
    with pytest.raises(ValueError, match="outside"):
        knockout_eval(model, pairs, [Head(5, 0)])
    with pytest.raises(ValueError, match="tokenizer="):  # a random tiny model names no folder: say what to pass
        knockout_eval(model, "niah", [Head(0, 0)])
    with pytest.raises(ValueError, match="only apply to a task given by name"):
        knockout_eval(model, pairs, [Head(0, 0)], context_length=64)


def test_auc():
    df = pd.DataFrame({"k": [0, 1, 2] * 3, "fraction": [0, 0.5, 1.0] * 3,
                       "selection": ["top"] * 3 + ["random"] * 6, "seed": [None] * 3 + [0] * 3 + [1] * 3,
                       "accuracy": [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0]})
    a = auc(df)
    # random mean curve: 1.0, 0.75, 1.0 at fractions 0, 0.5, 1 -> trapezoids 0.4375 + 0.4375
    assert a["top"] == pytest.approx(0.25) and a["random"] == pytest.approx(0.875)
    assert a["gap"] == pytest.approx(a["random"] - a["top"])
    with pytest.raises(ValueError, match="columns"):
        auc(df.drop(columns="selection"))


def test_knockout_n_samples_none_means_all_pairs(model):
    from headscope.tasks import from_pairs

    tok = word_tokenizer()
    task = from_pairs("three", [(f"a b the number is {a} c the answer is", f"a b the number is {b} c the answer is",
                                 f" {a}", f" {b}") for a, b in ((1, 2), (3, 4), (5, 6))])
    scores = HeadScores("three", torch.rand(1, 3, 4))
    for call in (lambda **kw: knockout_eval(model, task, [Head(0, 0)], tokenizer=tok, **kw),
                 lambda **kw: knockout_curve(model, task, scores, tokenizer=tok, ks=[0, 1], n_random=1,
                                             progress=False, **kw)):
        with pytest.raises(ValueError, match=r"knockout: n_samples=16 but task 'three' holds 3 pairs; "
                                             r"pass n_samples=None to use all 3"):
            call()  # the default 16
        call(n_samples=None)
    assert knockout_curve(model, task, scores, tokenizer=tok, ks=[0, 1], n_random=1, progress=False,
                          n_samples=None).attrs["n_samples"] == 3
    with pytest.raises(ValueError, match="n_samples=None means all pairs, but task 'niah' generates pairs"):
        knockout_eval(model, "niah", [Head(0, 0)], tokenizer=tok, n_samples=None)
