"""research.corpus.build on tiny fake packages: documents, deduplication, decontamination, the manifest, held-out
samples, byte-identical rebuilds."""
from __future__ import annotations

import gzip
import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from hybrid.train.text import DOC_SEP, MANIFEST_SCHEMA, read_documents
from research.corpus import build as b
from research.corpus import extract as ex
from research.corpus.packages import Package, read_members
from research.corpus.sources import Source

HELD = ("The lighthouse keeper counted the ships that passed the rocks each night and wrote their names in a "
        "green book that nobody else was allowed to read, not even the harbour master himself.")


def _tar(members: dict[str, bytes], mode: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as t:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 0
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def fake_deb(path: Path, members: dict[str, bytes]) -> Path:
    """A minimal Debian package: ar archive with debian-binary, control.tar.gz, data.tar.xz."""
    parts = [("debian-binary", b"2.0\n"), ("control.tar.gz", _tar({"./control": b"Package: fake\n"}, "w:gz")),
             ("data.tar.xz", _tar({f"./{k}": v for k, v in members.items()}, "w:xz"))]
    out = b"!<arch>\n"
    for name, data in parts:
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        out += b"\n" if len(data) % 2 else b""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(out)
    return path


def fake_sources(raw: Path) -> list[Source]:
    rst = (b"Title\n=====\n\n.. index:: hidden\n\nSee :func:`os.path.join` and ``x + 1``.\n\n"
           b".. note::\n\n   Mind the gap.\n")
    fake_deb(raw / "apt" / "fake-doc_1.0-1_all.deb", {
        "usr/share/doc/fake/a.rst.gz": gzip.compress(rst, mtime=0),
        "usr/share/doc/fake/b.rst": b"Another page\n------------\n\nPlain words here.\n",
        "usr/share/doc/fake/c.rst": b"Another page\n------------\n\nPlain   words here.\n",  # a duplicate of b
        "usr/share/doc/fake/d.rst": HELD.encode() + b"\n",  # held-out text: decontaminated
        "usr/share/doc/fake/skip.html": b"<p>not kept</p>"})
    (raw / "pypi").mkdir(parents=True)
    (raw / "pypi" / "fakecode-0.1.tar.gz").write_bytes(_tar({
        "fakecode-0.1/pkg/x.py": b"def add(a, b):\n\treturn a + b\n",
        "fakecode-0.1/pkg/y.py": b"Another page\n\nPlain words here.\n"}, "w:gz"))  # duplicate across sources
    (raw / "npm").mkdir(parents=True)
    (raw / "npm" / "fakeheld-2.0.0.tgz").write_bytes(_tar({"package/story.txt": HELD.encode() + b"\n\n" +
                                                           b"A second paragraph of the held-out story.\n"}, "w:gz"))
    root = "usr/share/doc/fake/"

    def docs(files):
        return ex.extract_files(read_members(files[0], lambda n: n.startswith(root) and ".rst" in n), ex.clean_rst,
                                lambda p: p[len(root):], skip_generated=False)

    def code(files):
        return ex.extract_files(read_members(files[0], lambda n: n.endswith(".py")), None, lambda p: p)

    def held(files):
        return ex.extract_files(read_members(files[0], lambda n: n.endswith(".txt")), None, lambda p: p)

    return [Source("fake_docs", "technical documentation: fake", "MIT", "train",
                   (Package("apt", "fake-doc", "1.0-1"),), "usr/share/doc/fake/*.rst", docs),
            Source("fake_code", "code: fake", "BSD-3-Clause", "train", (Package("pypi", "fakecode", "0.1"),),
                   "pkg/*.py", code),
            Source("fake_held", "prose: fake story", "public domain", "heldout", (Package("npm", "fakeheld", "2.0.0"),),
                   "package/story.txt", held, why="a register no training source has")]


@pytest.fixture
def corpus(tmp_path, ref_tokenizer):
    raw = tmp_path / "raw"
    sources = fake_sources(raw)
    fidelity = tmp_path / "fidelity"
    fidelity.mkdir()
    (fidelity / "sources.json").write_text('{\n "other": {"domain": "x", "licence": "y", "origin": "z",\n'
                                           '            "file": "other.txt"}\n}\n')
    (fidelity / "other.txt").write_text("Evaluation text kept elsewhere.\n")

    def run(out):
        return b.build(out, raw, fidelity=fidelity, fetch=False, tokenizer=ref_tokenizer, progress=False,
                       log=lambda *a: None, sources=sources)
    return run, tmp_path, fidelity


def test_documents_are_clean_deduplicated_and_decontaminated(corpus):
    run, tmp, _ = corpus
    m = run(tmp / "out")
    docs = read_documents(tmp / "out" / "sources" / "fake_docs.txt")
    assert docs[0] == "Title\n\nSee os.path.join and x + 1.\n\nNote:\n\n   Mind the gap.\n"  # markup stripped
    assert docs[1] == "Another page\n\nPlain words here.\n"
    assert len(docs) == 2  # c.rst (same words) deduplicated, d.rst (held-out text) decontaminated
    assert m["sources"]["fake_docs"]["duplicates_dropped"] == 1
    assert m["sources"]["fake_docs"]["decontaminated"] == ["d.rst"]
    code = read_documents(tmp / "out" / "sources" / "fake_code.txt")
    assert code == ["def add(a, b):\n    return a + b\n"]  # y.py duplicates a fake_docs document
    text = (tmp / "out" / "sources" / "fake_docs.txt").read_text()
    assert text == DOC_SEP.join(docs) and text.count("<|endoftext|>") == 1


def test_manifest_fields(corpus, ref_tokenizer):
    run, tmp, _ = corpus
    m = run(tmp / "out")
    assert m["schema"] == MANIFEST_SCHEMA and m["doc_separator"] == DOC_SEP
    assert json.loads((tmp / "out" / "manifest.json").read_text()) == m
    e = m["sources"]["fake_code"]
    assert {"domain", "licence", "split", "origin", "packages", "file", "sha256", "documents", "characters",
            "tokens", "weight"} <= set(e)
    assert e["origin"].startswith("fakecode==0.1, ") and e["split"] == "train" and e["licence"] == "BSD-3-Clause"
    assert e["packages"][0]["package"] == "fakecode==0.1" and e["packages"][0]["file"] == "fakecode-0.1.tar.gz"
    assert len(e["packages"][0]["sha256"]) == 64
    want = len(ref_tokenizer("def add(a, b):\n    return a + b\n", add_special_tokens=False)["input_ids"]) + 1
    assert e["tokens"] == want  # its ids and one end-of-text
    assert m["sources"]["fake_held"]["split"] == "heldout" and "weight" not in m["sources"]["fake_held"]
    assert abs(sum(v["weight"] for v in m["sources"].values() if v["split"] == "train") - 1.0) < 1e-5
    assert m["totals"]["train_tokens"] == m["sources"]["fake_docs"]["tokens"] + e["tokens"]


def test_heldout_sample_and_fidelity_entry_added_without_rewriting(corpus):
    run, tmp, fidelity = corpus
    before = (fidelity / "sources.json").read_text()
    run(tmp / "out")
    after = (fidelity / "sources.json").read_text()
    assert after.startswith(before.rstrip()[:-1].rstrip())  # the other entry's text untouched
    entries = json.loads(after)
    assert set(entries) == {"other", "fake_held"}
    assert entries["fake_held"] == {"domain": "prose: fake story", "licence": "public domain",
                                    "origin": "fakeheld==2.0.0, package/story.txt", "file": "fake_held.txt"}
    assert (fidelity / "fake_held.txt").read_text().startswith(HELD)
    run(tmp / "out")
    assert (fidelity / "sources.json").read_text() == after  # added once


def test_rebuild_is_byte_identical(corpus):
    run, tmp, _ = corpus
    run(tmp / "a")
    run(tmp / "a")  # in place: nothing changes
    run(tmp / "b")  # from scratch
    files = sorted(p.relative_to(tmp / "a") for p in (tmp / "a").rglob("*") if p.is_file())
    assert files and files == sorted(p.relative_to(tmp / "b") for p in (tmp / "b").rglob("*") if p.is_file())
    for f in files:
        assert (tmp / "a" / f).read_bytes() == (tmp / "b" / f).read_bytes(), f


def test_xz_sources_read_back(corpus, ref_tokenizer):
    run, tmp, fidelity = corpus
    plain = run(tmp / "p")
    packed = b.build(tmp / "x", tmp / "raw", fidelity=fidelity, fetch=False, tokenizer=ref_tokenizer, xz=True,
                     progress=False, log=lambda *a: None, sources=fake_sources(tmp / "raw2"))
    assert packed["sources"]["fake_docs"]["file"] == "sources/fake_docs.txt.xz"
    assert packed["sources"]["fake_docs"]["sha256"] == plain["sources"]["fake_docs"]["sha256"]  # of the text
    assert read_documents(tmp / "x" / "sources" / "fake_docs.txt.xz") == \
        read_documents(tmp / "p" / "sources" / "fake_docs.txt")


def test_missing_package_without_fetch_names_the_fix(tmp_path, ref_tokenizer):
    src = Source("nothing", "code: none", "MIT", "train", (Package("apt", "no-such-pkg", "1"),), "-", lambda f: [])
    with pytest.raises(FileNotFoundError, match="without --no-fetch"):
        b.build(tmp_path / "o", tmp_path / "raw", fidelity=tmp_path, fetch=False, tokenizer=ref_tokenizer,
                progress=False, log=lambda *a: None, sources=[src])


def test_sample_documents_fits_the_limit():
    docs = [(f"d{i}", f"paragraph {i} " * 50 + "\n") for i in range(20)]
    s = b.sample_documents(docs, limit=2000)
    assert len(s.encode()) <= 2000 and s.count("paragraph") >= 50
    big = b.sample_documents([("one", "line\n\n" * 1000)], limit=100)
    assert 0 < len(big.encode()) <= 100 and big.endswith("\n")


def test_package_patterns_and_commands(tmp_path):
    apt = Package("apt", "git-doc", "1:2.39.5-0+deb12u3")
    assert apt.pattern() == "git-doc_1%3a2.39.5-0+deb12u3_*.deb"
    assert apt.command(tmp_path) == ["apt-get", "download", "git-doc=1:2.39.5-0+deb12u3"]
    assert Package("pypi", "chatterbot-corpus", "1.3.3", wheel=True).pattern() == "chatterbot_corpus-1.3.3-*.whl"
    assert Package("npm", "lodash", "4.17.21").pattern() == "lodash-4.17.21.tgz"
    whl = tmp_path / "pypi" / "w_x-1.0-py3-none-any.whl"
    whl.parent.mkdir()
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("w_x/data/a.yml", "conversations:\n- - Hi\n  - Hello there\n")
    assert Package("pypi", "w-x", "1.0", wheel=True).find(tmp_path) == whl
    assert ex.extract_chatterbot(read_members(whl, lambda n: n.endswith(".yml"))) == [("a", "A: Hi\nB: Hello there\n")]
