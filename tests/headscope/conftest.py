"""Fixtures of the headscope tests."""
import pytest

from model_factories import tiny_model


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 saved with a tiny word-level tokenizer (digits split), as `--model PATH` expects."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the special magic number is what ? answer : . question".split()
    vocab = {"<unk>": 0, "<s>": 1, **{str(d): 2 + d for d in range(10)}, **{w: 12 + i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    path = tmp_path_factory.mktemp("tiny_model")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>").save_pretrained(path)
    tiny_model("qwen3").save_pretrained(path)
    return path
