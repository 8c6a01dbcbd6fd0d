"""A TransformerBridge scores like the plain model, and building one leaves the plain model scorable."""
import pytest
import torch

from headscope.api import score
from headscope.tasks import from_pairs

from model_factories import tiny_model

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]


def bos_word_tokenizer():
    """Words t4..t127 with a BOS token that the tokenizer does not add by default (like Qwen's): the
    tokenizer TransformerLens builds from it does prepend BOS."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    special = {"<unk>": 0, "<pad>": 1, "</s>": 2, "<s>": 3}
    tok = Tokenizer(models.WordLevel({**special, **{f"t{i}": i for i in range(4, 128)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
                                      bos_token="<s>")


def toy_task():
    words = [f"t{i}" for i in range(10, 60)]
    items = []
    for i in range(3):
        ctx = " ".join(words[i * 3: i * 3 + 12])
        items.append((f"{ctx} t{70 + i} t5 t6", f"{ctx} t{90 + i} t5 t6", f" t{70 + i}", f" t{90 + i}"))
    return from_pairs("toy", items)


def _score(model, tok=None):
    return score(model, toy_task(), tokenizer=tok, n_samples=3, progress=False, min_clean_accuracy=0.0)


def test_bridge_scores_like_the_plain_model_and_leaves_it_intact():
    pytest.importorskip("transformer_lens")
    from headscope.patching.tl import bridge_from_hf, bridge_tokenizer

    model = tiny_model("qwen3", attn_implementation="eager", initializer_range=0.2)
    tok = bos_word_tokenizer()
    before = _score(model, tok)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    bridge = bridge_from_hf(model, tok)
    # TransformerLens's own tokenizer prepends BOS; scoring must not use it
    assert bridge.tokenizer("t10 t11").input_ids[0] == 3 and tok("t10 t11").input_ids == [10, 11]
    assert bridge_tokenizer(bridge) is tok and tok("t10 t11").input_ids == [10, 11]
    on_bridge = _score(bridge)  # the tokenizer comes from the bridge
    assert on_bridge.settings["seq_lens"] == before.settings["seq_lens"]
    assert on_bridge.top(4) == before.top(4)
    assert (on_bridge.per_sample_raw - before.per_sample_raw).abs().max() < 1e-4

    # the plain model is still a plain HF model: same weights, same modules, same scores on the fast path
    assert type(model.model.layers[0]).__name__ == "Qwen3DecoderLayer"
    for k, v in model.state_dict().items():
        assert torch.equal(v, weights[k]), k
    after = _score(model, tok)
    assert torch.equal(after.per_sample_raw, before.per_sample_raw)
    # the bridge shares the parameters (no copy of the weights)
    shared = {p.data_ptr() for p in model.parameters()}
    assert all(p.data_ptr() in shared for p in bridge.original_model.parameters())


def test_a_bridge_booted_by_transformer_lens_scores_like_the_plain_model(tmp_path):
    """A bridge built with TransformerLens's own boot_transformers (whose tokenizer prepends BOS) is scored with
    the plain model's tokenizer found beside it: no BOS added, the same prompts and scores as the plain model."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM

    from headscope.tokenizers import find_tokenizer

    model = tiny_model("qwen3", attn_implementation="eager", initializer_range=0.2)
    tok = bos_word_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    before = _score(model, tok)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=hf)
    assert bridge.tokenizer("t10 t11").input_ids[0] == 3  # TransformerLens's tokenizer prepends BOS
    assert find_tokenizer(bridge)("t10 t11").input_ids == [10, 11]  # the model's own does not
    on_bridge = _score(bridge)
    assert on_bridge.settings["seq_lens"] == before.settings["seq_lens"]  # no BOS added
    assert (on_bridge.per_sample_raw - before.per_sample_raw).abs().max() < 1e-4


def test_a_bridge_without_the_plain_tokenizer_warns_that_it_adds_bos():
    pytest.importorskip("transformer_lens")
    from headscope.patching.tl import _TOKENIZER_ATTR, bridge_from_hf
    from headscope.tokenizers import find_tokenizer

    model = tiny_model("qwen3", attn_implementation="eager")
    bridge = bridge_from_hf(model, bos_word_tokenizer())
    delattr(bridge, _TOKENIZER_ATTR)  # as a bridge built elsewhere, from a model that names no folder
    bridge.original_model.config._name_or_path = ""
    with pytest.warns(UserWarning, match=r"prepends BOS \(id 3\).*tokenizer=<the model's tokenizer>"):
        found = find_tokenizer(bridge)
    assert found is bridge.tokenizer
    explicit = bos_word_tokenizer()
    assert find_tokenizer(bridge, explicit) is explicit  # an explicit tokenizer still wins, silently
