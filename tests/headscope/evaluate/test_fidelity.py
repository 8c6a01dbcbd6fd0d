"""The fidelity suite (headscope.evaluate.fidelity): a student against its teacher on held-out data.

Tiny models and a character tokenizer on small held-out files; the teacher against itself agrees exactly, a
perturbed copy does not; the metric names; the missing-teacher error; chat skipped without a template and computed
with one; the shipped held-out data and its loader's errors; the command line's --teacher on the reference model."""
import copy
import json
import os

import pytest
import torch

import headscope
from headscope.evaluate import get_evaluation, list_suites, read_results, save_results
from headscope.evaluate.fidelity import ANSWERS_FILE, LOOP_SHARE, MissingTeacherError, nll_ratios
from headscope.evaluate.fidelity_data import (DATA, UnknownSourceError, list_sources, load_instructions, load_source,
                                              load_sources, manifest)

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
TEXT_METRICS = {"perplexity_student", "perplexity_teacher", "perplexity_ratio", "kl_to_teacher", "top1_agreement"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two small held-out files (prose, code): 20,000 characters of two shipped sources."""
    d = tmp_path_factory.mktemp("heldout")
    paths = []
    for name, stem in (("shakespeare", "prose"), ("python_code", "code")):
        p = d / f"{stem}.txt"
        p.write_text(load_source(name)[1][:20_000], encoding="utf-8")
        paths.append(str(p))
    return paths


@pytest.fixture(scope="module")
def configs(sources):
    return {"fidelity_text": {"sources": sources, "window": 64, "n_windows": 4},
            "fidelity_continuation": {"sources": sources, "prefix": 32, "new_tokens": 32, "n": 4},
            "fidelity_chat": {"n": 6, "max_new_tokens": 8},
            "fidelity_niah": {"sources": sources, "lengths": (160, 400), "n": 2}}


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = char_tokenizer()
    t.chat_template = TEMPLATE
    return t


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def student(teacher):
    """The teacher with noise added to one layer's MLP."""
    s = copy.deepcopy(teacher)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in s.model.layers[1].mlp.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return s


def values(df, metric):
    return df[(df.metric == metric) & (df.status == "ok")].value.tolist()


def test_suites_registered_with_the_teacher_flag():
    assert {"fidelity", "fidelity_smoke"} <= set(list_suites())
    for name in ("fidelity_text", "fidelity_continuation", "fidelity_chat", "fidelity_niah"):
        assert get_evaluation(name).needs_teacher
    assert not get_evaluation("niah").needs_teacher


def test_fidelity_long_reference_reads_past_the_reference_positions():
    """fidelity_long_reference: held-out perplexity at 0.5x, 1x, 2x and 4x the reference model's 2048 positions."""
    from headscope.evaluate.api import plan

    label, cfgs = plan("fidelity_long_reference")
    cfg = dict(cfgs)
    assert label == "fidelity_long_reference" and list(cfg) == ["fidelity_long_text"]
    assert cfg["fidelity_long_text"].lengths == (1024, 2048, 4096, 8192) and cfg["fidelity_long_text"].sources == ()


def test_fidelity_reference_stays_within_the_reference_positions():
    """fidelity_reference: every length within the reference model's 2048 positions, NIAH at 1016 and 2040."""
    from headscope.evaluate.api import plan

    label, cfgs = plan("fidelity_reference")
    cfg = dict(cfgs)
    assert label == "fidelity_reference" and list(cfg) == ["fidelity_text", "fidelity_continuation",
                                                          "fidelity_chat", "fidelity_niah"]
    assert cfg["fidelity_text"].window == 1024 and cfg["fidelity_text"].sources == ()
    c = cfg["fidelity_continuation"]
    assert c.prefix + c.new_tokens <= 2048 and c.sources == ()
    assert tuple(cfg["fidelity_niah"].lengths) == (1016, 2040) and max(cfg["fidelity_niah"].lengths) + 8 <= 2048


def test_teacher_against_itself_agrees_exactly(teacher, tok, configs):
    df = headscope.evaluate(teacher, "fidelity", tok, teacher=teacher, configs=configs, progress=False)
    for metric, want in (("perplexity_ratio", 1.0), ("top1_agreement", 1.0), ("kl_to_teacher", 0.0),
                         ("continuation_agreement", 1.0), ("continuation_agreement_std", 0.0)):
        got = values(df, metric)
        assert len(got) == 2 and got == [want, want], (metric, got)
    assert values(df, "perplexity_student") == values(df, "perplexity_teacher")
    assert values(df, "accuracy_student") == values(df, "accuracy_teacher")
    assert df.attrs["meta"]["teacher"]["fingerprint"] == df.fingerprint.iloc[0]


def test_perturbed_student_drifts(student, teacher, tok, configs):
    df = headscope.evaluate(student, "fidelity", tok, teacher=teacher, configs=configs, progress=False)
    text = df[df.evaluation == "fidelity_text"]
    assert set(text.metric) == TEXT_METRICS and set(text.family) == {"prose", "code"}
    assert all(v > 1 for v in values(df, "perplexity_ratio"))
    assert all(v > 0 for v in values(df, "kl_to_teacher"))
    assert all(v < 1 for v in values(df, "top1_agreement"))
    assert all(v < 1 for v in values(df, "continuation_agreement"))
    for r in text[text.metric == "perplexity_ratio"].itertuples():
        s = text[(text.family == r.family) & (text.metric == "perplexity_student")].value.item()
        t = text[(text.family == r.family) & (text.metric == "perplexity_teacher")].value.item()
        assert r.value == pytest.approx(s / t) and r.n == 4 and r.context_length == 64
    assert set(df.metric) == TEXT_METRICS | {"continuation_agreement", "continuation_agreement_std", "chat_nll_ratio",
                                             "chat_nll_ratio_median", "accuracy_student", "accuracy_teacher"}
    niah = df[df.evaluation == "fidelity_niah"]
    assert set(niah.family) == {f"{p}+{s}" for p in ("code", "pin", "plain") for s in ("prose", "code")}
    ok = niah[niah.context_length == 160]
    assert (ok.status == "ok").all() and len(ok) == 2 * 6
    past = niah[niah.context_length == 400]  # the tiny model has 256 positions
    assert (past.status == "skipped").all() and past.note.str.contains("256 positions").all()


def test_missing_teacher_is_a_clear_error(teacher, tok):
    with pytest.raises(MissingTeacherError, match=r"teacher=.*--teacher"):
        headscope.evaluate(teacher, "fidelity_smoke", tok, progress=False)
    with pytest.raises(MissingTeacherError, match="fidelity_text"):
        headscope.evaluate(teacher, ["niah", "fidelity_text"], tok, progress=False)


def test_chat_skipped_without_a_template(teacher, tok):
    df = headscope.evaluate(teacher, "fidelity_chat", tok, teacher=teacher, progress=False)
    assert set(df.metric) == {"chat_nll_ratio", "chat_nll_ratio_median"} and (df.status == "skipped").all()
    assert df.note.str.contains("no chat template").all() and "artifacts" not in df.attrs


def test_chat_ratio_with_a_chat_template(student, teacher, chat_tok, tmp_path, monkeypatch):
    cfg = {"fidelity_chat": {"n": 6, "max_new_tokens": 8}}
    same = headscope.evaluate(teacher, "fidelity_chat", chat_tok, teacher=teacher, configs=cfg, progress=False)
    assert values(same, "chat_nll_ratio") == [1.0] and values(same, "chat_nll_ratio_median") == [1.0]
    assert values(same, "chat_same_answer") == [1.0]
    assert values(same, "chat_repeated_4grams_student") == values(same, "chat_repeated_4grams_teacher")
    df = headscope.evaluate(student, "fidelity_chat", chat_tok, teacher=teacher, configs=cfg, progress=False)
    ratio = values(df, "chat_nll_ratio")[0]
    assert ratio > 0 and df[df.metric == "chat_nll_ratio"].n.item() == 6
    records = df.attrs["artifacts"][ANSWERS_FILE]
    assert len(records) == 6 and records[0]["instruction"] == load_instructions()[0]["instruction"]
    ratios = [r["nll_student_answer"] / r["nll_teacher_answer"] for r in records]
    assert ratio == pytest.approx(sum(ratios) / len(ratios))
    calm = [r["ratio"] for r in records
            if r["student_repeated_4grams"] <= LOOP_SHARE and r["teacher_repeated_4grams"] <= LOOP_SHARE]
    no_loops = df[df.metric == "chat_nll_ratio_no_loops"]
    assert no_loops.n.item() == len(calm)
    if calm:
        assert no_loops.value.item() == pytest.approx(sum(calm) / len(calm))
    else:
        assert no_loops.value.isna().all() and no_loops.note.str.contains("has a loop").all()
    out = save_results(df, tmp_path / "res", figures=False)
    lines = (out / ANSWERS_FILE).read_text(encoding="utf-8").splitlines()
    assert len(lines) == 6 and set(json.loads(lines[0])) >= {"instruction", "topic", "kind", "teacher_answer",
                                                              "student_answer", "nll_teacher_answer",
                                                              "nll_student_answer"}
    assert len(read_results(out)) == len(df)
    synced = []
    monkeypatch.setattr(os, "fsync", synced.append)
    part = save_results(df, tmp_path / "part", figures=False, fsync=False)  # a suite part, saved again at the end
    assert synced == [] and len(read_results(part)) == len(df)
    assert (part / ANSWERS_FILE).read_text(encoding="utf-8") == (out / ANSWERS_FILE).read_text(encoding="utf-8")


def test_short_text_and_long_windows_are_noted_skips(teacher, tok, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Too short for a window.\n", encoding="utf-8")
    cfg = {"fidelity_text": {"sources": [str(short)], "window": 64},
           "fidelity_continuation": {"sources": [str(short)], "prefix": 32}}
    df = headscope.evaluate(teacher, ["fidelity_text", "fidelity_continuation"], tok, teacher=teacher, configs=cfg,
                            progress=False)
    assert (df.status == "skipped").all() and df.note.str.contains("too few").all() and set(df.family) == {"short"}
    cfg = {"fidelity_text": {"sources": ["python_docs"], "window": 300}}  # the tiny model has 256 positions
    df = headscope.evaluate(teacher, "fidelity_text", tok, teacher=teacher, configs=cfg, progress=False)
    assert (df.status == "skipped").all() and df.note.str.contains("300-token windows exceed the student's 256").all()


def test_nll_ratios():
    ratios, left_out = nll_ratios([2.0, 1.0, 3.0], [1.0, 1.0, 0.0])
    assert ratios == [2.0, 1.0, None] and left_out == 1
    with pytest.raises(ValueError):
        nll_ratios([1.0], [1.0, 2.0])


def test_answer_nll_batched_equals_one_at_a_time(teacher):
    from headscope.evaluate.fidelity_decoding import answer_nll, greedy_continuations
    from headscope.evaluate.runtime import EvalContext

    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
    answers = [[20, 21], [22], [23, 24, 25]]
    ctx = EvalContext(progress=False)
    batched = answer_nll(teacher, prompts, answers, ctx, pad_id=0)
    single = [answer_nll(teacher, [p], [a], ctx, pad_id=0)[0] for p, a in zip(prompts, answers)]
    assert batched == pytest.approx(single, abs=1e-4)
    gen = greedy_continuations(teacher, prompts, 5, ctx, pad_id=0)
    assert [len(g) for g in gen] == [5, 5, 5]
    stopped = greedy_continuations(teacher, prompts, 5, ctx, pad_id=0, stop_ids={gen[0][1]})
    assert stopped[0] == gen[0][:2]


def test_shipped_heldout_data():
    entries = manifest()
    assert {"shakespeare", "python_code", "python_docs"} <= set(list_sources())
    for name, entry in entries.items():
        assert entry["licence"] and entry["origin"] and entry["domain"]
        assert (DATA / entry["file"]).resolve().is_file(), name
    assert entries["shakespeare"]["file"].endswith("tasks/data/haystack_heldout.txt")  # referenced, not copied
    for name in list_sources():
        assert (DATA / entries[name]["file"]).stat().st_size < 600_000
    items = load_instructions()
    assert len(items) >= 60 and len({i["instruction"] for i in items}) == len(items)
    chat = entries["chat_heldout"]
    assert {i["topic"] for i in items} == set(chat["topics"]) and {i["kind"] for i in items} == set(chat["kinds"])


def test_source_loader_errors(tmp_path):
    with pytest.raises(UnknownSourceError, match="known sources: shakespeare"):
        load_source("klingon_poetry")
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_source(str(tmp_path / "missing.txt"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        load_source(str(bad))
    good = tmp_path / "notes.txt"
    good.write_text("some held-out words\n", encoding="utf-8")
    assert load_sources((str(good), "python_docs"))[0] == ("notes", "some held-out words\n")
    with pytest.raises(ValueError, match="twice"):
        load_sources((str(good), str(good)))
    with pytest.raises(UnknownSourceError):  # checked when the config is made, before any model runs
        headscope.evaluate(tiny_model("qwen3"), "fidelity_text", char_tokenizer(), teacher="default",
                           configs={"fidelity_text": {"sources": ["klingon_poetry"]}}, progress=False)


def test_cli_teacher(teacher, chat_tok, sources, tmp_path, capsys):
    """``headscope eval --teacher FOLDER``: refused without it, before loading; the answers file beside the results."""
    from headscope.cli import main

    folder = tmp_path / "tiny"
    teacher.save_pretrained(folder)
    chat_tok.save_pretrained(folder)
    out = tmp_path / "fid"
    sets = ["--set", f"fidelity_text.sources={json.dumps(sources)}", "--set", "fidelity_text.window=64",
            "--set", "fidelity_text.n_windows=2", "--set", "fidelity_chat.n=3",
            "--set", "fidelity_chat.max_new_tokens=4"]
    argv = ["eval", "--model", str(folder), "--suite", "fidelity_text", "fidelity_chat", "--out", str(out), "--quiet"]
    assert main(argv + sets) == 2
    assert "--teacher" in capsys.readouterr().err and not out.exists()
    assert main(argv + sets + ["--teacher", str(folder)]) == 0
    df = read_results(out)
    assert values(df, "perplexity_ratio") == [1.0, 1.0] and values(df, "chat_nll_ratio") == [1.0]
    assert len((out / ANSWERS_FILE).read_text(encoding="utf-8").splitlines()) == 3
    # --teacher-cache: the teacher's chat answers kept, then read back by the next run
    for k in (1, 2):
        cache = ["--teacher-cache", str(tmp_path / "tc"), "--overwrite"]
        assert main(argv + sets + ["--teacher", str(folder)] + cache) == 0
        meta = json.loads((out / "results.json").read_text())["teacher_cache"]
        assert (meta["read"], meta["computed"]) == ((0, 1) if k == 1 else (1, 0))


@pytest.mark.e2e
def test_smoke_suite_on_the_reference_model(tmp_path):
    """``headscope eval --model default --teacher default --suite fidelity_smoke``: exact self-agreement."""
    from headscope.cli import main

    out = tmp_path / "fid"
    assert main(["eval", "--model", "default", "--teacher", "default", "--suite", "fidelity_smoke", "--out",
                 str(out), "--quiet"]) == 0
    df = read_results(out)
    assert df.attrs["meta"]["teacher"]["model"].endswith("default")
    for metric, n in (("perplexity_ratio", len(list_sources())), ("top1_agreement", len(list_sources())),
                      ("kl_to_teacher", len(list_sources())), ("continuation_agreement", 3)):
        got = values(df, metric)
        assert len(got) == n and set(got) == {0.0 if metric == "kl_to_teacher" else 1.0}, (metric, got)
    assert (df[df.evaluation == "fidelity_chat"].status == "skipped").all()
    niah = df[df.evaluation == "fidelity_niah"]
    assert (niah[niah.context_length > 2048].status == "skipped").all()
    assert (niah[niah.context_length <= 2048].status == "ok").all()


def test_repeated_ngrams_finds_loops():
    from headscope.evaluate.fidelity import repeated_ngrams

    assert repeated_ngrams(list(range(20))) == 0.0 and repeated_ngrams([1, 2, 3]) == 0.0
    loop = [7, 8, 9, 10] * 5  # 17 4-grams, the first 4 new
    assert repeated_ngrams(loop) == pytest.approx(13 / 17)
    assert repeated_ngrams([1, 2, 3, 4, 1, 2, 3, 4, 5], n=4) == pytest.approx(1 / 6)
