"""Small offline tokenizers for tiny models: one token per character, or a few words and digits.

Import by plain name: `from char_tokenizer import char_tokenizer, word_tokenizer`.
"""


def char_tokenizer(size: int = 128):
    """One token per ASCII character (ids = code points), so natural-language tasks fit a 128-token model."""
    import transformers as tf
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {chr(i): i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", pad_token="\x00", eos_token="\x01")


def word_tokenizer():
    """A word-level tokenizer over "the number is answer a b c" and single digits (19 tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "the number is answer a b c".split()
    vocab = {"<unk>": 0, **{str(d): 1 + d for d in range(10)}, **{w: 11 + i for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
