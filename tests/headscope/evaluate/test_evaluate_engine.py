"""The scoring engine agrees with headscope.ablation.answer_correct (teacher forcing) on the reference model, and
generation is teacher forcing plus the stop check; the hybrid's equal-length batches."""
import pytest
import torch

from headscope.evaluate.engine import score_pairs, tensor_bytes
from headscope.evaluate.runtime import EvalContext

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ref():
    from headscope.reference import has_default_weights, load_model

    if not has_default_weights():
        pytest.skip("no default weights")
    return load_model()


def test_teacher_forcing_matches_answer_correct(ref):
    from headscope.ablation import answer_correct
    from headscope.tasks import get_task

    model, tok = ref
    pairs = get_task("niah", context_length=160, depth="uniform").tokenized(tok, 4, seed=3)
    pairs += get_task("reasoning").tokenized(tok, 8, seed=4)  # mixed lengths: left padding in one batch
    pairs += get_task("niah_multikey", context_length=160, n_keys=4).tokenized(tok, 4, seed=5)
    res = score_pairs(model, tok, pairs, EvalContext(batch_size=16, progress=False))
    want = answer_correct(model, pairs, batch_size=1).tolist()
    assert [r["tf"] for r in res] == want
    assert sum(want) >= 12  # the reference model solves most of these
    for r, p in zip(res, pairs):
        assert r["gen"] <= r["tf"]  # generation also needs the answer to stop
        if r["gen"]:
            assert r["generated"].startswith(tok.decode(p.clean_answer_ids))


def test_batch_size_does_not_change_results(ref):
    from headscope.tasks import get_task

    model, tok = ref
    pairs = get_task("reasoning").tokenized(tok, 8, seed=9)
    a = score_pairs(model, tok, pairs, EvalContext(batch_size=8, progress=False))
    b = score_pairs(model, tok, pairs, EvalContext(batch_size=1, progress=False))
    assert [(x["tf"], x["gen"], x["generated"]) for x in a] == [(x["tf"], x["gen"], x["generated"]) for x in b]


def test_continuing_the_answer_is_not_an_exact_match():
    from headscope.evaluate.engine import _continues
    from char_tokenizer import char_tokenizer

    tok = char_tokenizer()
    assert _continues(tok, " 4321", ord("5")) and not _continues(tok, " 4321", ord("."))
    assert not _continues(tok, " 4321", ord(" ")) and _continues(tok, " Alice", ord("s"))


def test_tensor_bytes_counts_each_tensor_once():
    t = torch.zeros(10, dtype=torch.float32)
    assert tensor_bytes({"a": t, "b": [t, torch.zeros(2, dtype=torch.int64)]}) == 40 + 16
