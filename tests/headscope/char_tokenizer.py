"""A one-token-per-character tokenizer for tiny 128-token models.

Import by plain name: `from char_tokenizer import char_tokenizer`.
"""


def char_tokenizer(size: int = 128):
    """One token per ASCII character (ids = code points), so natural-language tasks fit a 128-token model."""
    import transformers as tf
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    vocab = {chr(i): i for i in range(size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?", pad_token="\x00", eos_token="\x01")
