"""research.stage_harvest: what a GPU machine sends back while its job runs (the teacher's text once made, the
compile cache when it grew, within what a command returns), and stow, which puts those files in place here."""
from __future__ import annotations

import os
import tarfile

import pytest

from research import stage, stage_harvest
from research.stage_harvest import TEXT_ARCHIVE, harvest, stow, text_signature


@pytest.fixture
def machine(tmp_path):
    """A GPU machine's folders while job "j" runs: its copy of the checkout under RUNS/.repo_j, the caches."""
    runs, inductor, triton = tmp_path / "runs", tmp_path / "inductor", tmp_path / "triton"
    (runs / ".repo_j" / "data" / "corpus" / "teacher").mkdir(parents=True)
    (inductor / "fxgraph").mkdir(parents=True)
    (inductor / "fxgraph" / "g1").write_bytes(os.urandom(2000))
    (triton / "k1").mkdir(parents=True)
    (triton / "k1" / "kernel.cubin").write_bytes(b"cubin")
    return runs, inductor, triton


def _text(runs, json_too=True):
    teacher = runs / ".repo_j" / "data" / "corpus" / "teacher"
    (teacher / "teacher.txt").write_text("the teacher's answers\n" * 50)
    if json_too:
        (teacher / "teacher.json").write_text('{"counts": {}}\n')


def _out(tmp_path, name, n_files=0, size=10):
    out = tmp_path / name
    out.mkdir()
    for i in range(n_files):  # what the command already put there: pack's parts, the launcher's log
        (out / f"r.tgz.part{i:02d}").write_bytes(b"x" * size)
    return out


def test_harvest_sends_each_thing_once_it_exists_and_again_only_when_it_changed(tmp_path, machine):
    runs, inductor, triton = machine
    kw = dict(runs=runs, inductor=inductor, triton=triton)
    out1 = _out(tmp_path, "out1", n_files=2)
    _text(runs, json_too=False)  # self_distill still running: teacher.json comes last
    got = harvest("j", out1, **kw)
    assert [p.name for p in got] == ["compile_cache.tgz.part1of1"]  # the compile cache alone
    _text(runs)
    got = harvest("j", _out(tmp_path, "out2", n_files=2), **kw)
    assert [p.name for p in got] == [TEXT_ARCHIVE]  # the text, now whole; the caches did not change
    with tarfile.open(got[0], "r:xz") as tar:
        assert sorted(tar.getnames()) == ["teacher/teacher.json", "teacher/teacher.txt"]
    assert harvest("j", _out(tmp_path, "out3"), **kw) == []  # nothing new
    (triton / "k2").mkdir()
    (triton / "k2" / "kernel.cubin").write_bytes(b"another stage's kernel")
    got = harvest("j", _out(tmp_path, "out4"), **kw)
    assert [p.name for p in got] == ["compile_cache.tgz.part1of1"]  # the cache grew: all of it again
    with tarfile.open(got[0], "r:gz") as tar:
        assert {"triton/k1/kernel.cubin", "triton/k2/kernel.cubin", "inductor/fxgraph/g1"} <= set(tar.getnames())


def test_harvest_does_not_send_back_a_teachers_text_that_came_carried(tmp_path, machine, capsys):
    runs, inductor, triton = machine
    kw = dict(runs=runs, inductor=inductor, triton=triton)
    _text(runs)
    carried = tmp_path / "stage" / "teacher_text.carried"  # setup's, when it extracted the text from the parts
    carried.parent.mkdir()
    carried.write_text(text_signature(runs / ".repo_j" / "data" / "corpus") + "\n")
    token_cache = runs / ".repo_j" / "data" / "corpus" / "teacher" / "parts"
    token_cache.mkdir()  # what the job adds beside the text does not make it new
    (token_cache / "chunk_0000.npy").write_bytes(b"tokens")
    got = harvest("j", _out(tmp_path, "out1"), carried=carried, **kw)
    assert [p.name for p in got] == ["compile_cache.tgz.part1of1"]
    assert "came carried: not sent" in capsys.readouterr().out
    # a text the job made again (another size) is its own: sent
    (runs / ".repo_j" / "data" / "corpus" / "teacher" / "teacher.txt").write_text("other answers\n")
    got = harvest("j", _out(tmp_path, "out2"), carried=carried, **kw)
    assert [p.name for p in got] == [TEXT_ARCHIVE]


def test_harvest_leaves_for_the_next_command_what_does_not_fit(tmp_path, machine, capsys):
    runs, inductor, triton = machine
    kw = dict(runs=runs, inductor=inductor, triton=triton)
    _text(runs)
    full = _out(tmp_path, "full", n_files=8)  # a command returns 8 files at most
    assert harvest("j", full, **kw) == []
    assert "no room for the teacher's text" in capsys.readouterr().out
    assert len(list(full.iterdir())) == 8
    big = _out(tmp_path, "big", n_files=1, size=64 * 2**20 - 100)  # 64 MiB at most
    assert harvest("j", big, **kw) == []
    got = harvest("j", _out(tmp_path, "room"), **kw)  # not recorded as sent: the next command sends both
    assert sorted(p.name for p in got) == ["compile_cache.tgz.part1of1", TEXT_ARCHIVE]


def test_stow_puts_each_file_where_the_next_lease_reads_it(tmp_path, machine, capsys):
    runs, inductor, triton = machine
    _text(runs)
    out = _out(tmp_path, "out")
    harvest("j", out, runs=runs, inductor=inductor, triton=triton)
    results = tmp_path / "res" / "job1"
    results.mkdir(parents=True)
    (results / "steps.json").write_text("{}")
    stage.pack(results, out)
    (out / "job1.detached.log").write_text("log")
    repo = tmp_path / "repo"
    (repo / ".stage").mkdir(parents=True)
    (repo / ".stage" / "compile_cache.tgz.part1of2").write_bytes(b"an older set")
    (repo / ".stage" / "smollm2-135m.gguf.part1of6").write_bytes(b"kept")
    splits = []
    done = stow(sorted(out.iterdir()), repo, split_corpus=lambda: splits.append(1) or [repo / ".stage" / "c"],
                unpack=stage.unpack)
    teacher = repo / "data" / "corpus" / "teacher"
    assert (teacher / "teacher.txt").read_text() == "the teacher's answers\n" * 50 and (teacher / "teacher.json").exists()
    assert splits == [1]  # the corpus's parts made again, now with the teacher's text
    assert sorted(p.name for p in (repo / ".stage").iterdir()) == ["compile_cache.tgz.part1of1",
                                                                   "smollm2-135m.gguf.part1of6"]
    assert (repo / "runs" / "job1" / "steps.json").read_text() == "{}"
    assert set(done) == {"teacher_text", "corpus_parts", "compile_cache", "results"}
    assert "left where they are: job1.detached.log" in capsys.readouterr().out


def test_stow_refuses_a_partial_set_of_compile_cache_parts(tmp_path):
    (tmp_path / "compile_cache.tgz.part2of3").write_bytes(b"x")
    with pytest.raises(ValueError, match="not one whole set of 3"):
        stow([tmp_path / "compile_cache.tgz.part2of3"], tmp_path / "repo")
    assert stage.main(["stow", str(tmp_path / "compile_cache.tgz.part2of3")]) == 1  # a clear error, no traceback


def test_stow_refuses_an_archive_that_is_not_harvests(tmp_path):
    bad = tmp_path / TEXT_ARCHIVE
    with tarfile.open(bad, "w:xz") as tar:
        (tmp_path / "other.txt").write_text("x")
        tar.add(tmp_path / "other.txt", arcname="other.txt")
    with pytest.raises(ValueError, match="not harvest's archive"):
        stow([bad], tmp_path / "repo")
    assert not (tmp_path / "repo" / "data").exists()


def test_the_record_says_what_was_sent(tmp_path, machine):
    runs, inductor, triton = machine
    harvest("j", _out(tmp_path, "o"), runs=runs, inductor=inductor, triton=triton)
    record = (runs / "j.harvest.json").read_text()
    assert '"compile_cache"' in record and '"teacher_text"' not in record
    assert stage_harvest.OUT_FILES == 8 and stage_harvest.OUT_BYTES == 64 * 2**20
