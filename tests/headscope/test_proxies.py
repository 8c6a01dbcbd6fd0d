"""Cheap proxies (attention mass, attribution patching) and their agreement with exact scores."""
import random

import pytest
import torch

from headscope.ablation import ablate_heads
from headscope.arch import describe
from headscope.heads import Head
from headscope.hooks import record_inputs
from headscope.proxies import attention_retrieval_score, attribution_patching, compare_to_exact
from headscope.results import HeadScores

from char_tokenizer import word_tokenizer
from model_factories import tiny_model


@pytest.fixture(scope="module")
def pairs():
    from headscope.tasks import from_pairs

    rng = random.Random(0)
    items = []
    for _ in range(5):
        a, b = rng.sample(range(10), 2)
        items.append((f"a b the number is {a} c a b c the answer is", f"a b the number is {b} c a b c the answer is",
                      f" {a}", f" {b}"))
    return from_pairs("toy", items).tokenized(word_tokenizer())


def _exact_scores(model, pairs):
    """Activation patching head by head (the quantity AtP approximates)."""
    rows = []
    for p in pairs:
        pos = p.answer_pos

        def metric(logits):
            at = logits[0, pos]  # [A, V]
            diff = at.gather(-1, p.clean_answer_ids[:, None]) - at.gather(-1, p.corrupt_answer_ids[:, None])  # [A, 1]
            return float(diff.mean())

        with torch.no_grad():
            with record_inputs(describe(model).out_projs) as store:
                mx = metric(model(input_ids=p.corrupt_ids[None]).logits)
            mc = metric(model(input_ids=p.clean_ids[None]).logits)
            row = torch.zeros(3, 4, dtype=torch.float64)
            for l in range(3):
                for h in range(4):
                    patch = {Head(l, h): store[l][..., h * 16:(h + 1) * 16]}
                    with ablate_heads(model, [Head(l, h)], kind="patch", values=patch):
                        row[l, h] = (mc - metric(model(input_ids=p.clean_ids[None]).logits)) / (mc - mx)
        rows.append(row)
    return HeadScores("toy", torch.stack(rows))


def test_attention_score_reads_eager_attention_and_restores_sdpa(pairs):
    model = tiny_model("qwen3", attn_implementation="sdpa")
    s = attention_retrieval_score(model, pairs)
    assert model.config._attn_implementation == "sdpa"
    assert s.kind == "attention" and s.per_sample_raw.shape == (5, 3, 4) and s.n_kv_heads == 2
    assert (s.per_sample_raw >= 0).all() and (s.per_sample_raw <= 1 + 1e-6).all()
    eager = tiny_model("qwen3")
    p = pairs[0]
    with torch.no_grad():
        attn = eager(input_ids=p.clean_ids[None], output_attentions=True).attentions  # L x [1, H, T, S]
    want = attn[1][0, 2, p.answer_pos][:, p.diff_pos].sum(-1).mean()
    assert float(s.per_sample_raw[0, 1, 2]) == pytest.approx(float(want), rel=1e-5)


def test_attribution_patching_tracks_exact_patching(pairs):
    model = tiny_model("qwen3")
    atp = attribution_patching(model, pairs)
    exact = _exact_scores(model, pairs)
    assert atp.kind == "atp" and atp.per_sample_raw.shape == exact.per_sample_raw.shape
    # Last layer: the metric is nearly linear in z there (only the final norm in between), so AtP ~ exact.
    last_err = (atp.per_sample_raw[:, 2] - exact.per_sample_raw[:, 2]).abs().max()
    assert last_err < 0.25 * exact.per_sample_raw[:, 2].abs().max(), last_err
    # Earlier layers are first-order only; the ranking still agrees clearly above chance.
    from scipy.stats import spearmanr
    assert spearmanr(atp.per_sample_raw.flatten(), exact.per_sample_raw.flatten()).statistic > 0.4
    assert set(compare_to_exact(atp, exact, use="raw")) == {"spearman", "kendall", "topk_overlap", "k"}
    assert not any(p.requires_grad and p.grad is not None for p in model.parameters())


def test_attribution_patching_needs_a_differentiable_metric(pairs):
    with pytest.raises(ValueError, match="differentiable"):
        attribution_patching(tiny_model("qwen3"), pairs, metric=lambda logits, pair: 0.0)
    with pytest.raises(TypeError, match="TokenizedPairs"):
        attention_retrieval_score(tiny_model("qwen3"), [[1, 2, 3]])
    with pytest.raises(ValueError, match="empty"):
        attention_retrieval_score(tiny_model("qwen3"), [])


def test_compare_to_exact():
    a = HeadScores("t", torch.arange(12.).view(1, 3, 4) / 12)
    same = compare_to_exact(a, a)
    assert same["spearman"] == pytest.approx(1) and same["kendall"] == pytest.approx(1) and same["topk_overlap"] == 1
    rev = compare_to_exact(torch.arange(12.).view(3, 4).flip(0, 1), torch.arange(12.).view(3, 4), k=3)
    assert rev["spearman"] == pytest.approx(-1) and rev["topk_overlap"] == 0 and rev["k"] == 3
    with pytest.raises(ValueError, match="heads"):
        compare_to_exact(torch.zeros(2, 2), torch.zeros(3, 2))
