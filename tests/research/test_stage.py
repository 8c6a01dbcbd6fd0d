"""research.stage on small fake files: split / put round trip and the checksum refusal (a fake registry model),
wheels already installed, the Triton cache, pack / unpack of a results folder; and the corpus's
compressed copy (research.prepare_corpus)."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from headscope import zoo
from research import stage, stage_caches
from research.stage_harvest import text_signature


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A registry model "fake-gguf" whose GGUF is a 3 MB file of random bytes (found through its env variable)."""
    src = tmp_path / "fake.gguf"
    src.write_bytes(os.urandom(3_000_000))
    entry = zoo.ZooEntry(name="fake-gguf", distribution="fake-dist", filename="fake_dist/Fake.Q4.gguf",
                         sha256=hashlib.sha256(src.read_bytes()).hexdigest())
    zoo.MODELS.register("fake-gguf", entry)
    monkeypatch.setenv(entry.env_var, str(src))
    yield entry, src
    zoo.MODELS.unregister("fake-gguf")


def test_split_put_round_trip(fake_model, tmp_path, capsys):
    entry, src = fake_model
    assert stage.main(["split", "--model", "fake-gguf", "--part-mb", "1", "--out", str(tmp_path / "parts")]) == 0
    parts = sorted((tmp_path / "parts").iterdir())
    assert [p.name for p in parts] == [f"fake-gguf.gguf.part{k}of3" for k in (1, 2, 3)]
    assert all(p.stat().st_size <= 2**20 for p in parts)
    st = tmp_path / "stage"
    for i, p in enumerate(parts):
        assert stage.main(["put", str(p), "--stage-dir", str(st)]) == 0
        assert ("still missing" in capsys.readouterr().out) == (i < len(parts) - 1)
    joined = st / "Fake.Q4.gguf"
    assert joined.read_bytes() == src.read_bytes() and not list(st.glob("*.part*"))
    env = stage.read_env(st)
    assert env == {entry.env_var: str(joined), "HEADSCOPE_CACHE": str(st / "cache")}
    # env.sh is a shell file: sourcing it sets the variables
    import subprocess

    out = subprocess.run(["bash", "-c", f". {st / 'env.sh'} && echo ${entry.env_var}"], capture_output=True,
                         text=True).stdout.strip()
    assert out == str(joined)


def test_a_damaged_part_is_refused_and_the_parts_removed(fake_model, tmp_path, capsys):
    parts = stage.split("fake-gguf", 1, tmp_path / "parts")
    data = bytearray(parts[1].read_bytes())
    data[100] ^= 0xFF
    parts[1].write_bytes(bytes(data))
    st = tmp_path / "stage"
    codes = [stage.main(["put", str(p), "--stage-dir", str(st)]) for p in parts]
    assert codes == [0, 0, 1]
    err = capsys.readouterr().err
    assert "a part is damaged" in err and "stage again from part 1" in err
    assert not list(st.glob("*.part*")) and not (st / "Fake.Q4.gguf").exists() and not (st / "env.sh").exists()
    assert stage.main(["put", str(tmp_path / "fake-gguf.gguf.part1of3"), "--stage-dir", str(st)]) == 1
    assert "carry it with this command" in capsys.readouterr().err
    assert stage.main(["put", str(tmp_path / "whatever.bin")]) == 1
    assert "not a part name" in capsys.readouterr().err


def test_split_refuses_a_source_with_the_wrong_checksum(fake_model, tmp_path, capsys):
    entry, src = fake_model
    src.write_bytes(b"something else")
    assert stage.main(["split", "--model", "fake-gguf", "--out", str(tmp_path / "p")]) == 1
    assert f"expected {entry.sha256}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stage.main(["bogus"])


def test_wheels_already_in_the_target_are_skipped(tmp_path):
    target = tmp_path / "site"
    (target / "fake_pkg-1.0.dist-info").mkdir(parents=True)
    wheel = tmp_path / "whl" / "fake_pkg-1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    assert stage.wheels([str(tmp_path / "whl")], target, tmp_path / "st") == []
    assert str(target) in stage.read_env(tmp_path / "st")["PYTHONPATH"]
    with pytest.raises(stage.StageError, match="carry them"):
        stage.wheels([str(tmp_path / "none.whl")], target, tmp_path / "st")


def test_triton_cache_save_and_restore(tmp_path):
    cache = tmp_path / "cache"
    (cache / "abc").mkdir(parents=True)
    (cache / "abc" / "kernel.autotune.json").write_text('{"best": 1}')
    (cache / "abc" / "kernel.cubin").write_bytes(b"binary")  # not saved: results only
    assert stage.triton_save(tmp_path / "t.tgz", cache) == 1
    with tarfile.open(tmp_path / "t.tgz") as tar:
        assert tar.getnames() == ["abc/kernel.autotune.json"]
    assert stage.triton_restore([tmp_path / "t.tgz"], tmp_path / "fresh") == 1
    assert (tmp_path / "fresh" / "abc" / "kernel.autotune.json").read_text() == '{"best": 1}'
    assert stage.triton_save(tmp_path / "u.tgz", tmp_path / "empty") == 0


def test_pack_and_unpack_a_results_folder(tmp_path):
    run = tmp_path / "2026-12-03_job"
    (run / "run" / "checkpoints" / "s1").mkdir(parents=True)
    (run / "run" / "checkpoints" / "s1" / "state.pt").write_bytes(b"x" * 1000)
    (run / "logs").mkdir()
    (run / "logs" / "train.log").write_text("line\n" * 1000)
    (run / "results.json").write_text(json.dumps({"a": 1}))
    (run / "weights.bin").write_bytes(os.urandom(300_000))  # incompressible, over the budget below
    parts = stage.pack(run, tmp_path / "out", max_mb=0.1, part_bytes=20_000)
    assert len(parts) >= 1 and all(p.stat().st_size <= 20_000 for p in parts)
    back = stage.unpack(parts, tmp_path / "back")
    assert back == tmp_path / "back" / "2026-12-03_job"
    assert (back / "results.json").read_text() == '{"a": 1}' and (back / "logs" / "train.log").exists()
    assert not (back / "run" / "checkpoints").exists() and not (back / "weights.bin").exists()
    assert json.loads((back / "PACKED.json").read_text())["left_out"] == ["weights.bin"]


def test_the_corpus_travels_compressed(tmp_path):
    from research.prepare_corpus import ensure_corpus, write_gz

    corpus, gz = tmp_path / "corpus", tmp_path / "gz"
    corpus.mkdir()
    for part in ("train", "heldout"):
        (corpus / f"{part}.txt").write_text(f"{part} text\n" * 100)
    packed = write_gz(corpus, gz)
    assert [p.read_bytes() for p in packed] == [p.read_bytes() for p in write_gz(corpus, gz)]  # byte-identical
    assert ensure_corpus(corpus, gz) == []
    (corpus / "train.txt").unlink()
    assert ensure_corpus(corpus, gz) == [corpus / "train.txt"]
    assert (corpus / "train.txt").read_text() == "train text\n" * 100
    with pytest.raises(FileNotFoundError, match="python -m research.prepare_corpus"):
        ensure_corpus(tmp_path / "none", tmp_path / "nogz")


def test_the_broad_corpus_travels_in_parts(tmp_path, capsys):
    repo, there = tmp_path / "here", tmp_path / "there"
    src = repo / "data" / "corpus"
    (src / "sources").mkdir(parents=True)
    (src / "sources" / "a.txt").write_bytes(os.urandom(300_000))  # incompressible: several parts
    (src / "sources" / "held.txt").write_text("held out\n")
    (src / "manifest.json").write_text(json.dumps({"sources": {
        "a": {"file": "sources/a.txt", "split": "train"}, "held": {"file": "sources/held.txt", "split": "heldout"}}}))
    parts = stage.split_corpus(part_mb=0.1, out=tmp_path / "stage_out", repo=repo)
    assert [p.name for p in parts] == [f"corpus.tar.xz.part{k}of{len(parts)}" for k in range(1, len(parts) + 1)]
    assert len(parts) >= 3
    for p in parts[:-1]:
        assert stage.put_corpus(p, tmp_path / "st", repo=there) is False  # waits for the others
    assert stage.put_corpus(parts[-1], tmp_path / "st", repo=there) is True
    got = there / "data" / "corpus"
    assert (got / "sources" / "a.txt").read_bytes() == (src / "sources" / "a.txt").read_bytes()
    assert (got / "manifest.json").is_file() and not (got / "sources" / "held.txt").exists()  # training only
    assert list((tmp_path / "st").glob("corpus.*")) == []  # the parts are dropped once extracted
    with pytest.raises(stage.StageError, match="not a corpus part"):
        stage.put_corpus(tmp_path / "x.bin", tmp_path / "st", repo=there)
    with pytest.raises(stage.StageError, match="research.corpus.build"):
        stage.split_corpus(out=tmp_path / "o", repo=tmp_path / "empty")


def _broad_corpus(repo: Path, teacher: bool) -> Path:
    src = repo / "data" / "corpus"
    (src / "sources").mkdir(parents=True)
    (src / "sources" / "a.txt").write_text("a training source\n" * 50)
    (src / "manifest.json").write_text(json.dumps({"sources": {"a": {"file": "sources/a.txt", "split": "train"}}}))
    if teacher:
        (src / "teacher" / "parts").mkdir(parents=True)
        (src / "teacher" / "teacher.txt").write_text("the teacher's own text\n" * 50)
        (src / "teacher" / "teacher.json").write_text('{"tokens": 300}')
        (src / "teacher" / "parts" / "chunk_0000.txt").write_text("a chunk\n")
    return src


def test_the_broad_corpus_carries_the_teachers_text_when_made(tmp_path, capsys):
    repo = tmp_path / "here"
    src = _broad_corpus(repo, teacher=True)
    parts = stage.split_corpus(out=tmp_path / "o", repo=repo)
    assert "the teacher's text" in capsys.readouterr().out
    there = tmp_path / "there"
    assert [stage.put_corpus(p, tmp_path / "st", repo=there) for p in parts][-1] is True
    got = there / "data" / "corpus" / "teacher"
    assert (got / "teacher.txt").read_text() == (src / "teacher" / "teacher.txt").read_text()
    assert (got / "teacher.json").read_text() == '{"tokens": 300}'
    assert not (got / "parts").exists()  # the chunks stay here
    # its signature, for harvest, which then does not send the same text back
    assert (tmp_path / "st" / stage.CARRIED_TEXT).read_text().strip() == text_signature(there / "data" / "corpus")
    # --no-teacher: the sources only
    parts = stage.split_corpus(out=tmp_path / "o", repo=repo, teacher=False)
    assert "--no-teacher" in capsys.readouterr().out
    bare = tmp_path / "bare"
    assert [stage.put_corpus(p, tmp_path / "st2", repo=bare) for p in parts][-1] is True
    assert (bare / "data" / "corpus" / "sources" / "a.txt").is_file()
    assert not (bare / "data" / "corpus" / "teacher").exists()
    assert not (tmp_path / "st2" / stage.CARRIED_TEXT).exists()


def test_split_corpus_no_teacher_flag(monkeypatch):
    seen = []
    monkeypatch.setattr(stage, "split_corpus", lambda *a, **kw: seen.append(kw["teacher"]))
    assert stage.main(["split-corpus", "--no-teacher"]) == 0 and stage.main(["split-corpus"]) == 0
    assert seen == [False, True]


def test_the_broad_corpus_without_a_teachers_text(tmp_path, capsys):
    repo = tmp_path / "here"
    _broad_corpus(repo, teacher=False)
    parts = stage.split_corpus(out=tmp_path / "o", repo=repo)
    assert "no teacher's text" in capsys.readouterr().out
    import lzma

    with lzma.open(parts[0]) as xz, tarfile.open(fileobj=xz, mode="r:") as tar:
        assert sorted(tar.getnames()) == ["data/corpus/manifest.json", "data/corpus/sources/a.txt"]


def test_teacher_cache_save_and_restore_keeps_what_is_there(tmp_path):
    """The teacher cache's entries travel as a small archive: saved flat, restored into the cache folder without
    replacing an entry already there; members that are not flat .json files are skipped."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "chat-abc.json").write_text('{"value": 1}')
    (cache / "niah-def.json").write_text('{"value": 2}')
    (cache / "notes.txt").write_text("not an entry")
    assert stage.teacher_cache_save(tmp_path / "t.tgz", cache) == 2
    with tarfile.open(tmp_path / "t.tgz") as tar:
        assert sorted(tar.getnames()) == ["chat-abc.json", "niah-def.json"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "chat-abc.json").write_text('{"value": "newer"}')
    assert stage.teacher_cache_restore([tmp_path / "t.tgz"], fresh) == 1
    assert (fresh / "chat-abc.json").read_text() == '{"value": "newer"}'
    assert (fresh / "niah-def.json").read_text() == '{"value": 2}'
    import io
    with tarfile.open(tmp_path / "bad.tgz", "w:gz") as tar:  # a nested path is not an entry
        data = b'{"value": 3}'
        info = tarfile.TarInfo("sub/x-1.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert stage.teacher_cache_restore([tmp_path / "bad.tgz"], tmp_path / "other") == 0
    assert not (tmp_path / "other").exists()
    assert stage.teacher_cache_save(tmp_path / "u.tgz", tmp_path / "empty") == 0
    assert stage.main(["teacher-cache", "save", str(tmp_path / "v.tgz"), "--cache", str(cache)]) == 0
    assert (tmp_path / "v.tgz").is_file()


def test_setup_restores_the_teacher_cache_and_points_env_sh_at_it(tmp_path, monkeypatch):
    """setup() on a bare machine: the committed teacher-cache archives land in the cache folder, and env.sh exports
    HEADSCOPE_TEACHER_CACHE so that every job of the lease shares it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "niah-abc.json").write_text('{"value": 1}')
    gpu_cache = tmp_path / "gpu_cache"
    assert stage.teacher_cache_save(gpu_cache / "teacher_cache_x.tgz", src) == 1
    repo = tmp_path / "repo"
    repo.mkdir()
    cache = tmp_path / "runs" / "teacher_cache"
    monkeypatch.setattr(stage, "REPO", repo)
    monkeypatch.setattr(stage_caches, "GPU_CACHE", gpu_cache)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("HEADSCOPE_TEACHER_CACHE", str(cache))
    env = stage.setup(tmp_path / "st", tmp_path / "site")
    assert (cache / "niah-abc.json").read_text() == '{"value": 1}'
    assert stage.read_env(tmp_path / "st")["HEADSCOPE_TEACHER_CACHE"] == str(cache)
    assert env == tmp_path / "st" / "env.sh"


def test_compile_cache_travels_in_parts_and_setup_extracts_it_once_all_are_there(tmp_path, monkeypatch):
    """compile-cache save: torch.compile's and Triton's cache folders (locks left out) in parts; setup puts each
    carried part into the stage folder and, once all are there, extracts them (files already there kept)."""
    inductor, triton = tmp_path / "inductor", tmp_path / "triton"
    (inductor / "fxgraph" / "ab").mkdir(parents=True)
    (inductor / "fxgraph" / "ab" / "entry").write_bytes(os.urandom(3000))  # incompressible: several parts
    (inductor / "fxgraph" / "ab" / "entry.lock").write_text("")
    (triton / "k1").mkdir(parents=True)
    (triton / "k1" / "kernel.cubin").write_bytes(b"cubin")
    parts = stage_caches.compile_cache_save(tmp_path / "out", inductor, triton, part_bytes=1024)
    assert len(parts) >= 3 and all(p.stat().st_size <= 1024 for p in parts)
    assert [p.name for p in parts][-1].endswith(f"of{len(parts)}")
    repo = tmp_path / "repo"
    (repo / ".stage").mkdir(parents=True)
    new_inductor, new_triton = tmp_path / "new_inductor", tmp_path / "new_triton"
    (new_triton / "k1").mkdir(parents=True)
    (new_triton / "k1" / "kernel.cubin").write_bytes(b"kept")
    monkeypatch.setattr(stage, "REPO", repo)
    monkeypatch.setattr(stage_caches, "GPU_CACHE", tmp_path / "none")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(new_inductor))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(new_triton))
    monkeypatch.setenv("HEADSCOPE_TEACHER_CACHE", str(tmp_path / "tc"))
    shutil.copy2(parts[0], repo / ".stage" / parts[0].name)  # the first command carries one part
    stage.setup(tmp_path / "st", tmp_path / "site")
    assert not new_inductor.exists()
    (repo / ".stage" / parts[0].name).unlink()
    for p in parts[1:]:  # the others in the next commands
        shutil.copy2(p, repo / ".stage" / p.name)
        stage.setup(tmp_path / "st", tmp_path / "site")
        (repo / ".stage" / p.name).unlink()
    entry = ("fxgraph", "ab", "entry")
    assert new_inductor.joinpath(*entry).read_bytes() == inductor.joinpath(*entry).read_bytes()
    assert not (new_inductor / "fxgraph" / "ab" / "entry.lock").exists()
    assert (new_triton / "k1" / "kernel.cubin").read_bytes() == b"kept"
    assert not list((tmp_path / "st").glob("compile_cache*"))  # the parts dropped once extracted
    assert stage_caches.compile_cache_save(tmp_path / "o2", tmp_path / "empty1", tmp_path / "empty2") == []
    capped = stage_caches.compile_cache_save(tmp_path / "o3", inductor, triton, max_bytes=500)  # not the 3 kB entry
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in capped)), mode="r:gz") as tar:
        assert tar.getnames() == ["triton/k1/kernel.cubin"]  # past the cap: left out
