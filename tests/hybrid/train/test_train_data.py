from __future__ import annotations

import random
import re

import pytest
import torch
from train_factories import docs_of, write_manifest

from hybrid.train import data
from hybrid.train import text as train_text




def corpus_ids(tok):
    from headscope.tasks import load_haystack

    return train_text.tokenize_corpus(tok, load_haystack("heldout")[:60_000])


@pytest.mark.parametrize("chain", [0.0, 1.0])
def test_binding_extra_queries_ask_bound_values(ref_tokenizer, chain):
    from headscope.tasks import get_task

    rng = random.Random(0)
    for pair in get_task("binding", chain=chain).generate(ref_tokenizer, n=6, seed=1):
        head = pair.clean_prompt.split(". Then ")[0][len("Let "):]
        bound = dict(part.split(" = ") for part in head.split(", "))
        extra = data.extra_queries(pair, 3, rng)
        assert len(extra) == 3
        for query, answer in extra:
            name = re.fullmatch(r"\. Then ([a-z]) =", query).group(1)
            value = bound[name] if bound[name].isdigit() else bound[bound[name]]  # a chain copies a variable
            assert answer == f" {value}"


def test_multikey_extra_queries_ask_other_keys(ref_tokenizer):
    from headscope.tasks import get_task

    pair = get_task("niah_multikey", context_length=256, n_keys=4, haystack="heldout").generate(
        ref_tokenizer, n=1, seed=3)[0]
    extra = data.extra_queries(pair, 5, random.Random(0))
    assert len(extra) == 3  # the other three keys, each once
    keys = set()
    for query, answer in extra:
        key = re.search(r"number for (\w+)\? Answer", query).group(1)
        assert key != pair.meta["key"]
        assert f"The special magic number for {key} is{answer}." in pair.clean_prompt
        keys.add(key)
    assert len(keys) == 3
    assert data.extra_queries(get_task("arithmetic").generate(ref_tokenizer, n=1)[0], 3, random.Random(0)) == []


def test_encode_answers_marks_exactly_the_answer_tokens(ref_tokenizer):
    pieces = [("Let a = 3, b = 7. Then a =", False), (" 3", True), (". Then b =", False), (" 7", True)]
    ids, ans = data.encode_answers(ref_tokenizer, pieces)
    targets = "".join(ref_tokenizer.decode([ids[p + 1]]) for p in ans)
    assert targets == " 3 7"
    assert ids == ref_tokenizer("".join(p for p, _ in pieces), add_special_tokens=False)["input_ids"]


def test_packed_multikey_rows_fill_the_row_with_several_weighted_answers(ref_tokenizer):
    cfg = data.MixtureConfig(seq_len=512, tokens_per_batch=1024, multikey_min_len=128, haystack_weight=0.0,
                             extra_queries=2, haystack="heldout")  # data/corpus is not in a fresh clone
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    ids, w = stream.niah_row(512, random.Random(0), multikey=True)
    assert len(ids) == len(w) <= 512
    assert ids.count(ref_tokenizer.eos_token_id) >= 2  # at least two packed prompts
    n_answers = sum(1 for x in w if x == cfg.answer_weight)
    assert n_answers >= 10  # >= 2 prompts x one 4-digit value (5 tokens)
    assert set(w) <= {0.0, cfg.answer_weight}  # haystack_weight 0: only answers are trained
    batch = stream.batch(1, 1.0)
    assert batch["ids"].shape == batch["w"].shape and batch["ids"].shape[0] * batch["ids"].shape[1] <= 1024
    assert torch.all(batch["w"][:, -1] == 0)


@pytest.mark.parametrize("field,value,match", [
    ("extra_queries", 9, "extra_queries"),
    ("multikey_min_len", 32, "multikey_min_len"),
    ("haystack_weight", -1.0, "haystack_weight"),
    ("reasoning_families", ("binding", "nope"), "reasoning_families"),
    ("binding_vars", (1, 4), "binding_vars"),
    ("binding_vars", (6, 3), "binding_vars"),
])
def test_mixture_config_names_the_bad_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        data.MixtureConfig(**{field: value})


@pytest.mark.parametrize("multikey,ctx", [(False, 500), (True, 120), (True, 1000)])
def test_fast_niah_prompts_use_the_task_templates_and_about_the_length(ref_tokenizer, multikey, ctx):
    from headscope.tasks.niah import KEYED_QUESTION, QUESTION

    cfg = data.MixtureConfig(seq_len=1024, tokens_per_batch=1024, fast_niah=True, haystack="heldout")
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    rng = random.Random(5)
    for _ in range(5):
        pair = stream.fast_niah_pair(ctx, rng, multikey, n_keys=3)
        value = pair.clean_answer.strip()
        assert re.fullmatch(r"[1-9]\d{3}", value) and not data.is_heldout_value(pair.clean_answer)
        n = len(ref_tokenizer(pair.clean_prompt + pair.clean_answer, add_special_tokens=False)["input_ids"])
        assert ctx - 8 <= n <= ctx + 2
        if multikey:
            key = pair.meta["key"]
            assert pair.clean_prompt.endswith(KEYED_QUESTION.format(key=key))
            assert f"The special magic number for {key} is {value}." in pair.clean_prompt
            assert len(data.KEYED_VALUE.findall(pair.clean_prompt)) == 3
        else:
            assert pair.clean_prompt.endswith(QUESTION)
            assert f"The special magic number is {value}." in pair.clean_prompt
    ids, w = stream.niah_example(ctx, rng, multikey, n_keys=3)
    assert len(ids) == len(w) and sum(1 for x in w if x == cfg.answer_weight) >= 5


def test_binding_vars_draws_the_variable_count_per_example(ref_tokenizer):
    cfg = data.MixtureConfig(reasoning_families=("binding",), binding_vars=(2, 8), seq_len=256, tokens_per_batch=256,
                             min_len=256)
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    ids, w = stream.reasoning_row(4000, random.Random(0))
    text = ref_tokenizer.decode(ids)
    counts = {len(re.findall(r"[a-z] = \d", ex.split(". Then ")[0])) for ex in text.split("<|endoftext|>") if "Then" in ex}
    assert min(counts) == 2 and max(counts) == 8  # direct bindings per example span the range (a chain adds a copy)
    assert sum(x == cfg.answer_weight for x in w) >= len(counts)  # every example's answer is weighted


def test_default_binding_vars_keep_the_family_mixture_of_stages_1_to_3(ref_tokenizer):
    cfg = data.MixtureConfig(reasoning_families=("binding", "two_hop"), seq_len=256, tokens_per_batch=256, min_len=256)
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    assert stream.reasoning_task(random.Random(0)).name == "reasoning"  # same data stream as the shipped stages


def test_batches_are_a_function_of_the_step_and_rows_split_over_processes(ref_tokenizer):
    cfg = data.MixtureConfig(seq_len=128, tokens_per_batch=4 * 128, min_len=128, haystack="heldout", w_copy=0.3)
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer), stage="0:align")
    a, b = stream.batch(7), stream.batch(7)
    assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["w"], b["w"])  # the data position is the step
    assert not torch.equal(stream.batch(8)["ids"], a["ids"])
    halves = [stream.batch(7, rows=data.rank_rows(4, r, 2)) for r in range(2)]
    assert torch.equal(torch.cat([h["ids"] for h in halves]), a["ids"])  # two processes build the same batch
    other = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer), stage="1:distill")
    assert not torch.equal(other.batch(7)["ids"], a["ids"])  # stages draw different data
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        data.rank_rows(5, 0, 2)


def test_step_batches_in_workers_arrive_in_step_order(ref_tokenizer):
    cfg = data.MixtureConfig(seq_len=64, tokens_per_batch=128, min_len=64, haystack="heldout")
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    loader = torch.utils.data.DataLoader(data.StepBatches(stream, 3, 9, 9), batch_size=None, num_workers=2,
                                         multiprocessing_context="spawn")  # as the trainer starts them
    got = list(loader)
    assert [int(b["step"]) for b in got] == list(range(3, 9))
    assert all(torch.equal(b["ids"], stream.batch(int(b["step"]), int(b["step"]) / 9)["ids"]) for b in got)


def test_a_worker_start_up_message_stays_small_and_the_stream_survives_it(ref_tokenizer):
    """A spawned worker's start-up message over 64 KiB (a pipe) makes workers start one after another."""
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (tensors through shared memory, as in DataLoader)

    cfg = data.MixtureConfig(seq_len=128, tokens_per_batch=2 * 128, min_len=128, haystack="heldout")
    stream = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer), stage="0:align")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(data.StepBatches(stream, 0, 4, 4))
    assert len(buf.getvalue()) < 16_384
    copy = ForkingPickler.loads(buf.getvalue()).stream
    assert copy.tok.get_vocab() == ref_tokenizer.get_vocab()
    assert torch.equal(copy.batch(3)["ids"], stream.batch(3)["ids"])


def test_teacher_rows_come_from_the_teacher_samples(ref_tokenizer):
    cfg = data.MixtureConfig(seq_len=64, tokens_per_batch=256, min_len=64, haystack="heldout", w_text=0, w_niah=0,
                             w_multikey=0, w_reasoning=0, w_copy=0, w_teacher=1.0)
    with pytest.raises(ValueError, match="teacher_ids"):
        data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer))
    pool = torch.arange(1000, 1500)  # [500] stand-in teacher text
    batch = data.MixtureStream(cfg, ref_tokenizer, corpus_ids(ref_tokenizer), teacher_ids=pool).batch(0)
    assert set(batch["kind"].tolist()) == {data.KINDS.index("teacher")}
    assert ((batch["ids"] >= 1000) & (batch["ids"] < 1500)).all()


# ---- the broad corpus: weighted text sources (a corpus manifest, research.corpus.build) ----------------------------
def test_weighted_sources_draw_text_rows_by_weight(ref_tokenizer):
    parts = [(name, w, torch.full((2000,), tok)) for name, w, tok in (("a", 5.0, 11), ("b", 3.0, 12), ("c", 2.0, 13))]
    sources = train_text.TextSources.join(parts + [("unused", 0.0, torch.full((10,), 14))])
    assert sources.names == ("a", "b", "c") and sources.weights == (0.5, 0.3, 0.2)
    cfg = data.MixtureConfig(seq_len=32, tokens_per_batch=32 * 64, min_len=32, text_only=True)
    stream = data.MixtureStream(cfg, ref_tokenizer, sources)
    rows = torch.cat([stream.batch(step)["ids"] for step in range(40)])  # [2560, 32]
    assert all(len(set(r.tolist())) == 1 for r in rows)  # every window inside one source
    share = {t: (rows[:, 0] == t).float().mean().item() for t in (11, 12, 13)}
    assert abs(share[11] - 0.5) < 0.04 and abs(share[12] - 0.3) < 0.04 and abs(share[13] - 0.2) < 0.04
    with pytest.raises(ValueError, match="fewer tokens than seq_len"):
        data.MixtureStream(cfg, ref_tokenizer, train_text.TextSources.join(parts + [("tiny", 1.0, torch.ones(20))]))


def test_data_config_source_fields_are_checked_and_leave_old_fingerprints_alone(tmp_path):
    from hybrid.train.config import DataConfig, TrainConfig, TrainConfigError

    d = DataConfig(corpus="data/corpus/manifest.json", sources={"b": 1, "a": 0.5})
    assert d.sources == (("a", 0.5), ("b", 1.0))
    assert DataConfig(corpus="m.json", sources=[["b", 1], ["a", 0.5]]).sources == d.sources  # as to_dict writes it
    with pytest.raises(TrainConfigError, match="need corpus = a corpus manifest"):
        DataConfig(sources={"a": 1.0})
    with pytest.raises(TrainConfigError, match="sources.a"):
        DataConfig(corpus="m.json", sources={"a": -1})
    with pytest.raises(TrainConfigError, match="teacher_corpus_share"):
        DataConfig(teacher_corpus="t", teacher_corpus_share=1.5)
    base = {"out": str(tmp_path), "mask": "m.json", "stages": [{"name": "align", "steps": 1, "lr": 1e-3}]}
    cfg = TrainConfig.from_dict(base)
    assert not {"sources", "teacher_corpus", "teacher_corpus_share"} & set(cfg.to_dict()["data"])  # as before
    rich = TrainConfig.from_dict({**base, "data": {"corpus": "m.json", "sources": {"a": 1.0}}})
    assert rich.to_dict()["data"]["sources"] == [["a", 1.0]]
    assert TrainConfig.from_dict(rich.to_dict()) == rich and rich.fingerprint() != cfg.fingerprint()


def test_a_run_trains_on_a_corpus_manifest_and_refuses_its_heldout_sources(tmp_path, tiny_teacher_dir, tiny_mask):
    from hybrid.train import run
    from train_factories import stage, tiny_config

    path = write_manifest(tmp_path / "corpus", {"prose": ("train", 1.0, docs_of("river", 60)),
                                                "held": ("heldout", None, docs_of("kept", 60))})
    mix = {"corpus": path, "text": 0.75, "reasoning": 0.25, "niah": 0.0, "multikey": 0.0, "copy": 0.0}
    trainer = run(tiny_config(tmp_path / "out", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=2)],
                              data=mix))
    assert len(trainer.history) >= 2
    with pytest.raises(train_text.HeldOutSourceError, match="'held' is a held-out source"):
        run(tiny_config(tmp_path / "out2", tiny_teacher_dir, tiny_mask, stages=[stage("align", steps=2)],
                        data={**mix, "sources": {"held": 1.0}}))


def test_weighted_sources_survive_a_spawned_worker(ref_tokenizer):
    import io
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401  (tensors through shared memory, as in DataLoader)

    sources = train_text.TextSources.join([("a", 1.0, torch.arange(3000)), ("b", 1.0, torch.arange(5000, 8000))])
    cfg = data.MixtureConfig(seq_len=64, tokens_per_batch=256, min_len=64, haystack="heldout")
    stream = data.MixtureStream(cfg, ref_tokenizer, sources, stage="0:align")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(data.StepBatches(stream, 0, 4, 4))
    assert len(buf.getvalue()) < 16_384  # the ids travel through shared memory
    copy = ForkingPickler.loads(buf.getvalue()).stream
    assert copy.sources.names == ("a", "b") and torch.equal(copy.batch(2)["ids"], stream.batch(2)["ids"])


# ---- long rows: windows from documents (text_windows = "documents") -------------------------------------------------
def synthetic_sources(eos: int):
    """Three sources, their documents ended by ``eos``: "long" (documents of 20K-45K tokens), "short" (400-3000),
    "mixed" (both); token id 1_000_000 * (source + 1) + its position in the source, so a row names where it lies."""
    import random

    rng = random.Random(0)
    parts = []
    for k, (name, sizes) in enumerate((("long", (20_000, 45_000)), ("short", (400, 3_000)),
                                       ("mixed", (400, 45_000)))):
        docs, n = [], 0
        while n < 150_000:
            size = rng.randint(*sizes)
            docs.append(torch.cat([1_000_000 * (k + 1) + torch.arange(n, n + size - 1), torch.tensor([eos])]))
            n += size
        parts.append((name, 1.0, torch.cat(docs)))
    return train_text.TextSources.join(parts)


@pytest.mark.parametrize("T,windows", [(16_384, "documents"), (32_768, "documents"), (32_768, "random")])
def test_long_rows_start_at_documents_and_never_leave_their_source(ref_tokenizer, T, windows):
    """Rows longer than most documents: a source's documents joined by their end-of-text tokens, never a token of
    another source. "documents": from a document's start, or inside one long document; "random" (the default):
    anywhere in the source."""
    eos = ref_tokenizer.eos_token_id
    sources = synthetic_sources(eos)
    cfg = data.MixtureConfig(seq_len=T, tokens_per_batch=T * 4, min_len=T, text_only=True, text_windows=windows)
    stream = data.MixtureStream(cfg, ref_tokenizer, sources, stage="3:long")
    starts = set(stream.document_starts())
    assert starts >= set(sources.bounds[:-1]) and len(starts) == int((sources.ids == eos).sum())
    seen = {"inside": 0, "joined": 0}
    for step in range(12):
        batch = stream.batch(step)
        assert batch["ids"].shape == (4, T)
        for row in batch["ids"]:
            words = row[row != eos]
            k = {int(t) // 1_000_000 - 1 for t in words}
            assert len(k) == 1  # one source: never a token of another (nor of a held-out one, absent from sources)
            k = k.pop()
            lo, hi = sources.span(k)
            start = lo + int(row[0]) - 1_000_000 * (k + 1)  # where the row lies in the concatenated ids
            assert lo <= start and start + T <= hi and torch.equal(sources.ids[start:start + T].long(), row)
            if (row[:-1] == eos).any():  # documents joined with the source's next ones
                assert start in starts or windows == "random"  # "documents": from a document's start
                seen["joined"] += 1
            else:  # inside one document
                seen["inside"] += 1
    assert seen["inside"] and seen["joined"]
    if windows == "documents":
        assert not hasattr(stream, "_docs") or stream.__getstate__()["_docs"] is None  # rebuilt in a worker


def test_document_windows_near_a_source_end_and_in_a_corpus_without_documents(ref_tokenizer):
    import random

    eos = ref_tokenizer.eos_token_id
    ids = torch.cat([torch.full((90,), 11), torch.tensor([eos]), torch.full((29,), 12), torch.tensor([eos])])  # [121]
    sources = train_text.TextSources.join([("a", 1.0, ids), ("b", 1.0, torch.full((200,), 13))])
    cfg = data.MixtureConfig(seq_len=64, tokens_per_batch=64, min_len=64, text_only=True, text_windows="documents")
    stream = data.MixtureStream(cfg, ref_tokenizer, sources)
    assert stream.document_starts() == [0, 91, 121]
    rng = random.Random(0)
    got = {stream.document_window(0, 121, 64, rng) for _ in range(200)}
    # the 91-token document: inside it (0..27); the 30-token one (start 91): too late for 64 tokens, so the window
    # starts at the last document start that leaves room, 0
    assert got <= set(range(0, 28)) and 0 in got
    assert {stream.document_window(121, 321, 64, rng) for _ in range(100)} <= set(range(121, 258))  # one document
    plain = data.MixtureStream(cfg, ref_tokenizer, torch.arange(1000, 2000))  # no end-of-text: one document
    assert plain.document_starts() == [0]
    row = plain.batch(0)["ids"][0]  # [64]
    assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 64))


def test_text_windows_field_is_checked_and_leaves_old_fingerprints_alone(tmp_path):
    from hybrid.train.config import DataConfig, TrainConfig, TrainConfigError

    with pytest.raises(TrainConfigError, match=r"data\.text_windows='docs': must be one of \('random', 'documents'\)"):
        DataConfig(text_windows="docs")
    with pytest.raises(ValueError, match="text_windows"):
        data.MixtureConfig(text_windows="docs")
    base = {"out": str(tmp_path), "mask": "m.json", "stages": [{"name": "align", "steps": 1, "lr": 1e-3}]}
    cfg = TrainConfig.from_dict(base)
    assert cfg.data.text_windows == "random" and "text_windows" not in cfg.to_dict()["data"]  # as before
    long = TrainConfig.from_dict({**base, "data": {"text_windows": "documents"}})
    assert long.to_dict()["data"]["text_windows"] == "documents" and TrainConfig.from_dict(long.to_dict()) == long
    assert long.fingerprint() != cfg.fingerprint()
    stage = long.stages[0]
    assert data.mixture_config(long.data, stage, 0).text_windows == "documents"
    assert data.mixture_config(cfg.data, stage, 0).text_windows == "random"
