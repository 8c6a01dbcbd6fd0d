"""Template-transfer phrasings: each prompt carries its own needle and question, none shares the trained wording."""
import pytest

from headscope.evaluate.phrasings import PHRASINGS, PhrasedNiahTask
from headscope.tasks.niah import NEEDLE, QUESTION

from char_tokenizer import char_tokenizer


@pytest.mark.parametrize("phrasing", sorted(PHRASINGS))
def test_prompt_uses_the_phrasing(phrasing):
    needle, question = PHRASINGS[phrasing]
    for tp in PhrasedNiahTask(context_length=220, phrasing=phrasing, depth="uniform").tokenized(
            char_tokenizer(), n=2, seed=1):
        value = tp.pair.clean_answer.strip()
        assert needle.format(value=value) in tp.pair.clean_prompt
        assert tp.pair.clean_prompt.endswith(question)


def test_transfer_phrasings_share_no_wording_with_the_trained_one():
    assert PHRASINGS["trained"] == (NEEDLE, QUESTION)
    for name, (needle, question) in PHRASINGS.items():
        if name != "trained":
            assert "magic" not in needle + question and "special" not in needle + question
    assert len(PHRASINGS) - 1 >= 3


def test_unknown_phrasing():
    with pytest.raises(ValueError, match="phrasing='nope'"):
        PhrasedNiahTask(phrasing="nope")
