"""headscope.reference: the offline loader (tiny models in tmp_path) and the shipped reference model."""
from __future__ import annotations

import pytest
import torch

from headscope.reference import ReferenceModelMissing, default_path, has_default_weights, load_model

from model_factories import tiny_model

SHIPPED_SKIP = pytest.mark.skipif(
    not has_default_weights(),
    reason="headscope/weights/default holds no model weights yet: train them with "
           "research/reference/train_reference.py (docs/reference_model.md)")


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate("a b c d e f g h".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="[UNK]")


@pytest.fixture
def tiny_folder(tmp_path):
    model = tiny_model("qwen3", vocab_size=16)
    model.save_pretrained(tmp_path / "tiny", max_shard_size="100KB")  # several shards, like the shipped model
    _tiny_tokenizer().save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model


def test_load_local_folder_matches_saved_model(tiny_folder):
    path, ref = tiny_folder
    model, tok = load_model(path)
    assert not model.training
    assert tok.pad_token_id == tok.eos_token_id == 0  # pad falls back to eos
    ids = torch.tensor([tok("a b c d").input_ids])  # [1, T]
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_load_dtype(tiny_folder):
    model, _ = load_model(tiny_folder[0], dtype=torch.bfloat16, attn_implementation="eager")
    assert next(model.parameters()).dtype == torch.bfloat16


def test_missing_folder_and_empty_folder_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReferenceModelMissing, match="no Hugging Face model"):
        load_model(tmp_path / "empty")
    with pytest.raises(ReferenceModelMissing, match="never downloads"):
        load_model("no-such-org/no-such-model-headscope-test")


def test_default_missing_names_the_training_script(monkeypatch, tmp_path):
    import headscope.reference as ref

    monkeypatch.setattr(ref, "_WEIGHTS_DIR", tmp_path)
    with pytest.raises(ReferenceModelMissing, match="train_reference.py"):
        load_model()


def test_refusals_name_the_problem(tiny_folder, tmp_path):
    """A folder that does not exist (no training hint), a file, a folder without tokenizer files (transformers
    would silently build a one-token tokenizer), a CUDA device without CUDA."""
    from headscope.reference import MissingTokenizerError, load_tokenizer

    for missing in (tmp_path / "nope", str(tmp_path / "nope"), "./nope", "no/such/folder"):
        with pytest.raises(ReferenceModelMissing, match="does not exist") as err:
            load_model(missing)
        assert "train" not in str(err.value)
    (tmp_path / "file.bin").write_bytes(b"x")
    with pytest.raises(ReferenceModelMissing, match="is a file"):
        load_model(tmp_path / "file.bin")
    path, _ = tiny_folder
    for f in path.iterdir():
        if "token" in f.name:
            f.unlink()
    for load in (load_model, load_tokenizer):
        with pytest.raises(MissingTokenizerError, match="holds no tokenizer: none of tokenizer.json"):
            load(path)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(path, device="cuda")


def test_check_device():
    from headscope.reference import check_device

    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        check_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            check_device(torch.device("cuda", 0))


# ----------------------------------------------------------------------------- the shipped model

@pytest.fixture(scope="module")
def shipped():
    return load_model()


@SHIPPED_SKIP
def test_shipped_loads_offline_with_plain_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(default_path(), local_files_only=True)
    tok = AutoTokenizer.from_pretrained(default_path(), local_files_only=True)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.max_position_embeddings >= 2048
    assert 5e6 <= sum(p.numel() for p in model.parameters()) <= 15e6
    assert len(tok(" 4321").input_ids) == len(tok(" 8765").input_ids)


@SHIPPED_SKIP
def test_shipped_generates(shipped):
    model, tok = shipped
    ids = torch.tensor([tok("To be, or not to be").input_ids])  # [1, T]
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id)
    assert out.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(out[0, ids.shape[1]:]), str)


# Every task family of the issue, at short contexts (docs/reference_model.md, measured on the H200 at 2040
# tokens: NIAH 100%, multi-key NIAH 92-94%, arithmetic, comparison, two_hop and binding 100%).
@SHIPPED_SKIP
@pytest.mark.parametrize("task,cfg", [
    ("niah", dict(context_length=256, depth="uniform", haystack="heldout")),
    ("niah_multikey", dict(context_length=256, depth="random", haystack="heldout", n_keys=4)),
    ("arithmetic", {}),
    ("comparison", {}),
    ("two_hop", {}),
    ("binding", {}),
])
def test_shipped_solves_short_tasks(shipped, task, cfg):
    from headscope.ablation import answer_accuracy
    from headscope.tasks import get_task

    model, tok = shipped
    pairs = get_task(task, **cfg).tokenized(tok, 8, seed=4242)
    assert answer_accuracy(model, pairs, batch_size=8) >= 0.75


@SHIPPED_SKIP
def test_shipped_has_real_retrieval_heads(shipped):
    """The issue's scientific check at a short context: knocking out the top 5% of heads by NIAH receiver score
    breaks NIAH, knocking out as many random other heads does not (H200 numbers at 2040 tokens: 100 -> 16 or 4 and
    100 -> 99.75 or 100 (two seeds), docs/reference_model.md)."""
    import random

    import headscope
    from headscope.ablation import ablate_heads, answer_accuracy, head_means
    from headscope.tasks import get_task

    model, tok = shipped
    cfg = dict(context_length=256, depth="uniform", haystack="heldout")
    scores = headscope.score(model, "niah", tokenizer=tok, n_samples=8, seed=1, progress=False, **cfg)
    k = round(0.05 * scores.n_layers * scores.n_heads)  # 3 of 64
    top = scores.top(k)
    pairs = get_task("niah", **cfg).tokenized(tok, 24, seed=77)  # fresh prompts, not the scored ones
    means = head_means(model, [p.clean_ids for p in get_task("niah", **cfg).tokenized(tok, 8, seed=78)])
    base = answer_accuracy(model, pairs)
    with ablate_heads(model, top, kind="mean", values=means):
        top_acc = answer_accuracy(model, pairs)
    others = [h for h in scores.ranking() if h not in set(top)]
    rng = random.Random(0)
    rand = []
    for _ in range(5):
        with ablate_heads(model, rng.sample(others, k), kind="mean", values=means):
            rand.append(answer_accuracy(model, pairs))
    assert base >= 0.9
    assert base - top_acc >= 0.5, (top, base, top_acc)
    assert base - sum(rand) / len(rand) <= 0.1, (base, rand)
