"""hybrid.train.text: the text a mixture's rows read (a corpus manifest's weighted sources, the teacher's cached text,
held-out sources refused, token ids cached on disk) and text sampled from the teacher."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from train_factories import docs_of, write_manifest

from hybrid.train import text as train_text


def test_sample_teacher_is_seeded_and_leaves_the_global_rng_alone(ref_tokenizer):
    from model_factories import tiny_model

    model = tiny_model("qwen3")
    tok = type("Tok", (), {"bos_token_id": 1, "eos_token_id": 2})()
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = train_text.sample_teacher(model, tok, n_rows=3, length=10, temperature=1.0, seed=5)
    assert torch.equal(torch.get_rng_state(), before)
    b = train_text.sample_teacher(model, tok, n_rows=3, length=10, temperature=1.0, seed=5)
    assert a.shape == (30,) and torch.equal(a, b)
    assert not torch.equal(a, train_text.sample_teacher(model, tok, n_rows=3, length=10, temperature=1.0, seed=6))


def test_load_text_reads_a_manifest_and_caches_its_tokens(tmp_path, ref_tokenizer):
    from hybrid.train.config import DataConfig

    path = write_manifest(tmp_path, {"prose": ("train", 0.75, docs_of("river")), "code": ("train", 0.25,
                                     docs_of("def")), "held": ("heldout", None, docs_of("kept"))})
    text = train_text.load_text(DataConfig(corpus=path), ref_tokenizer)
    assert isinstance(text, train_text.TextSources)
    assert text.names == ("code", "prose") and text.weights == (0.25, 0.75)  # held-out sources never drawn
    want = train_text.tokenize_documents(ref_tokenizer, docs_of("def"))  # [n] each document ends with EOS
    lo, hi = text.span(0)
    assert torch.equal(text.ids[lo:hi], want) and int(want[-1]) == ref_tokenizer.eos_token_id
    assert text.ids.dtype == torch.int32
    assert len(list((tmp_path / "tokens").glob("*.pt"))) == 2  # cached on disk for the next run
    train_text._SOURCE_CACHE.clear()
    assert torch.equal(train_text.load_text(DataConfig(corpus=path), ref_tokenizer).ids, text.ids)
    one = train_text.load_text(DataConfig(corpus=path, sources={"prose": 2.0}), ref_tokenizer)
    assert one.names == ("prose",) and one.weights == (1.0,)
    memo: dict = {}
    assert train_text.load_text(DataConfig(corpus=path), ref_tokenizer, memo) is train_text.load_text(
        DataConfig(corpus=path), ref_tokenizer, memo)


def test_training_refuses_a_heldout_source(tmp_path, ref_tokenizer):
    from hybrid.train.config import DataConfig

    path = write_manifest(tmp_path, {"prose": ("train", 1.0, docs_of("river")),
                                     "held": ("heldout", None, docs_of("kept"))})
    with pytest.raises(train_text.HeldOutSourceError, match=r"'held' is a held-out source .*Remove it from data.sources; "
                                                      r"the training sources are \['prose'\]"):
        train_text.load_text(DataConfig(corpus=path, sources={"prose": 1.0, "held": 0.5}), ref_tokenizer)
    with pytest.raises(ValueError, match="'nope' is not a source"):
        train_text.load_text(DataConfig(corpus=path, sources={"nope": 1.0}), ref_tokenizer)
    import headscope

    fidelity = Path(headscope.__file__).parent / "evaluate" / "data" / "fidelity" / "python_docs.txt"
    with pytest.raises(train_text.HeldOutSourceError, match="is an evaluation file"):
        train_text.load_text(DataConfig(corpus=str(fidelity)), ref_tokenizer)
    with pytest.raises(FileNotFoundError, match="python -m research.corpus.build"):
        train_text.load_text(DataConfig(corpus=str(tmp_path / "none" / "manifest.json")), ref_tokenizer)


def test_teacher_corpus_is_one_more_weighted_source(tmp_path, ref_tokenizer):
    from hybrid.train.config import DataConfig

    path = write_manifest(tmp_path, {"prose": ("train", 1.0, docs_of("river"))})
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / train_text.TEACHER_TEXT).write_text(train_text.DOC_SEP.join(docs_of("answer")))
    text = train_text.load_text(DataConfig(corpus=path, teacher_corpus=str(teacher), teacher_corpus_share=0.25),
                          ref_tokenizer)
    assert text.names == ("prose", train_text.TEACHER_SOURCE) and text.weights == (0.75, 0.25)
    plain = tmp_path / "plain.txt"
    plain.write_text("".join(docs_of("plain", 40)))
    mixed = train_text.load_text(DataConfig(corpus=str(plain), teacher_corpus=str(teacher / "teacher.txt")), ref_tokenizer)
    assert mixed.names == ("corpus", train_text.TEACHER_SOURCE) and mixed.weights == (0.5, 0.5)
    alone = train_text.load_text(DataConfig(corpus=str(plain)), ref_tokenizer)  # the single-file corpus, as before
    assert isinstance(alone, torch.Tensor) and torch.equal(alone, train_text.load_corpus(str(plain), ref_tokenizer))
    with pytest.raises(FileNotFoundError, match="research.corpus.self_distill"):
        train_text.load_text(DataConfig(corpus=path, teacher_corpus=str(tmp_path / "none")), ref_tokenizer)


@pytest.mark.parametrize("before", [None, "false"])
def test_a_source_is_tokenized_with_the_tokenizers_threads_on_and_the_setting_restored(tmp_path, ref_tokenizer,
                                                                                       monkeypatch, before):
    """A study worker runs with TOKENIZERS_PARALLELISM=false (against forked children); a corpus's first
    tokenization turns the library's threads on for its own duration only, and gives the same ids."""
    import os

    if before is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", before)
    seen = []
    real = train_text.tokenize_documents

    def spy(tok, docs, *a, **k):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return real(tok, docs, *a, **k)

    monkeypatch.setattr(train_text, "tokenize_documents", spy)
    path = tmp_path / "s.txt"
    path.write_text("\n\n".join(docs_of("river")), encoding="utf-8")
    train_text._SOURCE_CACHE.clear()
    ids = train_text.source_ids(path, ref_tokenizer)  # [n]
    assert seen == ["true"] and os.environ.get("TOKENIZERS_PARALLELISM") == before
    assert torch.equal(ids, real(ref_tokenizer, train_text.read_documents(path)))
