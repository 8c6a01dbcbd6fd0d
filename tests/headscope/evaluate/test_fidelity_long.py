"""The long-context fidelity suite (headscope.evaluate.fidelity_long): a student past its teacher's positions.

A tiny Qwen3 teacher of 256 positions and its hybrid (whose config keeps the teacher's 256, which is no limit) with a
character tokenizer, at lengths inside and past 256: the student's rows at every length, the teacher's where it has the
positions and "not_applicable" past them, its chunked perplexity everywhere; haystacks extended with other held-out
sources when a source is short."""
import math

import pytest
import torch

import headscope
from headscope.evaluate import get_evaluation, list_suites
from headscope.evaluate.fidelity_data import list_sources, load_source
from headscope.evaluate.fidelity_long import (HAYSTACK_MARGIN, NOT_APPLICABLE, FidelityLongNiahConfig,
                                              FidelityLongTextConfig, chunked_nll, long_haystack, sequence_nll)
from headscope.evaluate.runtime import EvalContext

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]
TEXT = {"perplexity_student", "perplexity_teacher", "perplexity_ratio", "kl_to_teacher", "top1_agreement",
        "perplexity_teacher_chunked", "perplexity_ratio_chunked", "perplexity_student_chunked", "long_context_ratio"}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("qwen3")  # 256 positions


@pytest.fixture(scope="module")
def student(teacher):
    from headscope.mask import HeadMask
    from hybrid.convert import from_mask

    return from_mask(teacher, HeadMask.for_model(teacher, FA)).eval()


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A held-out prose file of 6,000 characters and a short one of 400 (a haystack to extend)."""
    d = tmp_path_factory.mktemp("heldout")
    prose, short = d / "prose.txt", d / "short.txt"
    prose.write_text(load_source("shakespeare")[1][:6_000], encoding="utf-8")
    short.write_text(load_source("python_docs")[1][:400], encoding="utf-8")
    return [str(prose), str(short)]


def ok(df, metric, **where):
    d = df[(df.metric == metric) & (df.status == "ok")]
    for k, v in where.items():
        d = d[d[k] == v]
    return d


def test_the_suite_is_registered_with_the_teacher_flag_and_long_defaults():
    assert "fidelity_long" in list_suites()
    assert get_evaluation("fidelity_long_text").needs_teacher and get_evaluation("fidelity_long_niah").needs_teacher
    assert FidelityLongTextConfig().lengths == (8192, 16384, 32768)
    assert FidelityLongNiahConfig().lengths == (16376, 32760, 65528)  # 8 positions left for the answer
    assert FidelityLongNiahConfig().n == 2
    with pytest.raises(ValueError, match="lengths"):
        FidelityLongTextConfig(lengths=(16,))
    with pytest.raises(ValueError, match="phrasings"):
        FidelityLongNiahConfig(phrasings=("nope",))


def test_text_rows_inside_and_past_the_teachers_positions(student, teacher, tok, sources, tmp_path):
    cfg = {"fidelity_long_text": {"sources": sources[:1], "lengths": [128, 512], "n_windows": 2}}
    df = headscope.evaluate(student, "fidelity_long_text", tok, teacher=teacher, configs=cfg, progress=False)
    assert set(df.metric) == TEXT and set(df.context_length) == {128, 512} and set(df.family) == {"prose"}
    inside, past = df[df.context_length == 128], df[df.context_length == 512]
    assert (inside.status == "ok").all()
    assert set(past[past.status == NOT_APPLICABLE].metric) == TEXT - {
        "perplexity_student", "perplexity_teacher_chunked", "perplexity_ratio_chunked", "perplexity_student_chunked",
        "long_context_ratio"}
    assert past[past.status == NOT_APPLICABLE].note.str.contains("past the teacher's 256 positions").all()
    # inside: the chunked perplexity is the teacher's own (one chunk)
    assert ok(df, "perplexity_teacher_chunked", context_length=128).value.tolist() == ok(
        df, "perplexity_teacher", context_length=128).value.tolist()
    s, t = (ok(df, m, context_length=512).value.item() for m in ("perplexity_student", "perplexity_teacher_chunked"))
    assert math.isfinite(s) and math.isfinite(t) and ok(df, "perplexity_ratio_chunked", context_length=512
                                                         ).value.item() == pytest.approx(s / t)
    # the student on the same tokens in chunks of the teacher's 256 positions; inside, one chunk: its own, ratio 1
    sc = ok(df, "perplexity_student_chunked", context_length=512).value.item()
    assert ok(df, "long_context_ratio", context_length=512).value.item() == pytest.approx(s / sc) and sc != s
    assert ok(df, "long_context_ratio", context_length=128).value.tolist() == [1.0]
    assert ok(df, "perplexity_student_chunked", context_length=128).value.tolist() == ok(
        df, "perplexity_student", context_length=128).value.tolist()
    # the teacher's chunked perplexity past its positions: kept by a teacher cache, read back, the same rows
    cols = ["metric", "value", "family", "context_length", "status"]
    for k in (1, 2):
        c = headscope.evaluate(student, "fidelity_long_text", tok, teacher=teacher, configs=cfg, progress=False,
                               teacher_cache=tmp_path / "tc")
        assert c[cols].equals(df[cols]) and c.attrs["meta"]["teacher_cache"]["read"] == k - 1


def test_chunked_nll_reads_each_chunk_from_an_empty_context(teacher):
    ctx = EvalContext(progress=False, batch_size=2)
    windows = torch.randint(3, 128, (3, 201))  # [3, 201]
    whole = sequence_nll(teacher, windows, ctx)  # [3, 200]
    assert whole.shape == (3, 200) and torch.equal(chunked_nll(teacher, windows, 256, ctx), whole)
    chunked = chunked_nll(teacher, windows, 64, ctx)  # chunks of 64 positions: 0..63, 64..127, 128..191, 192..199
    for c in (0, 64, 128, 192):
        part = sequence_nll(teacher, windows[:, c:min(200, c + 64) + 1], ctx)
        torch.testing.assert_close(chunked[:, c:c + part.shape[1]], part)
    assert not torch.allclose(chunked[:, 64:], whole[:, 64:])  # a fresh context is another prediction


def test_niah_rows_past_the_teachers_positions_and_extended_haystacks(student, teacher, tok, sources, tmp_path):
    cfg = {"fidelity_long_niah": {"sources": sources, "phrasings": ["code"], "lengths": [200, 400], "n": 1}}
    df = headscope.evaluate(student, "fidelity_long_niah", tok, teacher=teacher, configs=cfg, progress=False)
    assert set(df.family) == {"code+prose", "code+short"} and set(df.context_length) == {200, 400}
    stud = df[df.metric == "accuracy_student"]
    assert len(stud) == 4 and (stud.status == "ok").all() and stud.value.between(0, 1).all()
    teach = df[df.metric == "accuracy_teacher"]
    assert len(teach) == 4 and (teach[teach.context_length == 200].status == "ok").all()
    past = teach[teach.context_length == 400]
    assert len(past) == 2 and (past.status == NOT_APPLICABLE).all() and past.value.isna().all()
    assert past.note.str.contains("past the teacher's 256 positions").all()
    # the 400-character source is extended with the held-out text after it (the sources given, then the other
    # shipped ones: shakespeare) for a 400-token prompt (9/8 x 400 = 450)
    short = stud[stud.family == "code+short"].set_index("context_length").note
    assert short[400].startswith("haystack: short + shakespeare") and "fewer than 1.125 x 400" in short[400]
    assert not isinstance(short[200], str)  # long enough alone for 200 tokens
    assert stud[stud.family == "code+prose"].note.isna().all()
    cols = ["metric", "value", "family", "context_length", "status", "note"]
    for k in (1, 2):  # the teacher's NIAH (where it has the positions) kept by a teacher cache and read back
        c = headscope.evaluate(student, "fidelity_long_niah", tok, teacher=teacher, configs=cfg, progress=False,
                               teacher_cache=tmp_path / "tc")
        assert c[cols].equals(df[cols]) and c.attrs["meta"]["teacher_cache"]["read"] == k - 1
    cfg["fidelity_long_niah"]["teacher_beyond_positions"] = True
    beyond = headscope.evaluate(student, "fidelity_long_niah", tok, teacher=teacher, configs=cfg, progress=False)
    run = beyond[(beyond.metric == "accuracy_teacher") & (beyond.context_length == 400)]
    assert (run.status == "ok").all() and run.note.str.contains("past the teacher's 256 positions").all()


def test_long_haystack_appends_other_sources_in_order():
    order = [("a", "A text"), ("b", "B text"), ("c", "C text"), ("d", "D text")]
    tokens = {"a": 100, "b": 50, "c": 30, "d": 500}
    assert long_haystack("a", order, tokens, 80) == ("A text\n", ["a"])  # 100 >= 90
    assert long_haystack("b", order, tokens, 80) == ("B text\n\nC text\n\nD text\n", ["b", "c", "d"])  # 580 >= 90
    assert long_haystack("c", order, tokens, 200)[1] == ["c", "d"]
    assert long_haystack("d", order, tokens, 500)[1] == ["d", "a"]  # wrapping around
    assert long_haystack("c", order, tokens, 10_000)[1] == ["c", "d", "a", "b"]  # all there is


def test_the_shipped_heldout_haystacks_reach_64k_smollm2_tokens():
    """With SmolLM2's tokenizer (when its converted folder is in the headscope cache) every shipped source's haystack
    at 16K, 32K and 64K holds 9/8 of the length: the short sources are extended, never with training text."""
    from pathlib import Path

    from headscope.tasks.haystack import tokenize_text
    from headscope.zoo import cache_root

    folder = cache_root() / "smollm2-135m"
    if not (folder / "tokenizer.json").exists():
        pytest.skip("SmolLM2's tokenizer is not in the headscope cache (headscope.load_model('smollm2-135m'))")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    order = [load_source(n) for n in list_sources()]
    tokens = {n: len(tokenize_text(tok, t)) for n, t in order}
    for L in FidelityLongNiahConfig().lengths:
        for name, _ in order:
            used = long_haystack(name, order, tokens, L)[1]
            assert sum(tokens[n] for n in used) >= HAYSTACK_MARGIN * L and set(used) <= set(list_sources())


def test_a_hybrids_greedy_continuations_batch_rows_of_any_length(student, monkeypatch):
    # the hybrid takes no padding; its own greedy_decode batches ragged rows on its static cache: the same tokens
    # as the equal-length batches of the step-by-step loop, stop tokens cut the same way
    from headscope.evaluate import fidelity_decoding as fd

    calls = []
    real = type(student).greedy_decode
    monkeypatch.setattr(type(student), "greedy_decode", lambda self, p, n: calls.append(len(p)) or real(self, p, n))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17], [18, 19, 20]]
    ctx = EvalContext(progress=False, batch_size=8)
    fast = fd.greedy_continuations(student, prompts, 6, ctx, pad_id=0)
    assert calls == [4]  # one batch of four rows of three lengths
    stop = {fast[1][2]}
    fast_stopped = fd.greedy_continuations(student, prompts, 6, ctx, pad_id=0, stop_ids=stop)
    monkeypatch.setattr(type(student), "greedy_decode", None)  # the step-by-step loop, equal-length batches
    assert fd.greedy_continuations(student, prompts, 6, ctx, pad_id=0) == fast
    assert fd.greedy_continuations(student, prompts, 6, ctx, pad_id=0, stop_ids=stop) == fast_stopped
    assert fast_stopped[1] == fast[1][:3] and all(len(g) == 6 or g[-1] in stop for g in fast_stopped)
