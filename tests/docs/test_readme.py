"""README.md: its install and test commands are the ones CI runs (.ci/run), its quick-start commands and its Python
snippet run as written (e2e), and no user doc narrates how the project was built or cites a file that is not in the
repository."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(block: str) -> list[str]:
    return [s for s in (line.strip() for line in block.splitlines()) if s and not s.startswith("#")]


def ci_lines() -> tuple[list[str], dict[str, list[str]]]:
    """.ci/run's command lines before its first '# --- NAME (README) ---' marker, and the lines of each section."""
    before: list[str] = []
    sections: dict[str, list[str]] = {}
    current = None
    for line in CI.read_text().splitlines():
        s = line.strip()
        m = re.fullmatch(r"# --- (\w+) \(README\) ---", s)
        if m:
            current = sections.setdefault(m.group(1), [])
        elif s and not s.startswith("#"):
            (before if current is None else current).append(s)
    return before, sections


def readme_block(word: str) -> list[str]:
    found = [b for b in blocks(README.read_text(), "bash") if word in b]
    assert len(found) == 1, f"README.md should have exactly one ```bash block with {word!r}, found {len(found)}"
    return command_lines(found[0])


SETUP, TEST = "scripts/setup.sh", "scripts/test.sh"


def quick_start_blocks() -> list[str]:
    """Every ```bash block of the README except the setup, the by-hand install and the test blocks."""
    return [b for b in blocks(README.read_text(), "bash")
            if not any(w in b for w in ("pip install", "pytest", SETUP, TEST))]


def test_readme_setup_command_is_what_ci_runs():
    """One setup command in the README, run by CI as written; CI may add --no-run (install only), which the README
    documents: the main job it skips is the README's first quick start, which the end-to-end lane runs."""
    before, sections = ci_lines()
    extra = [c for c in before if c not in ("set -euo pipefail", 'cd "$(dirname "$0")/.."')]
    assert not extra, f".ci/run runs {extra} before the README's setup command"
    assert readme_block(SETUP) == [SETUP]
    ci = sections.get("setup")
    assert ci in ([SETUP], [f"{SETUP} --no-run"]), f".ci/run's setup section is {ci}"
    if ci != [SETUP]:
        assert f"`{SETUP} --no-run` installs only" in README.read_text()
        assert "headscope run --model default --out mask.json" in command_lines(quick_start_blocks()[0])


def test_readme_test_command_is_what_ci_runs():
    _, sections = ci_lines()
    assert sections.get("test"), ".ci/run has no '# --- test (README) ---' section"
    assert readme_block(TEST) == sections["test"] == [TEST]


def test_the_test_script_runs_the_two_lanes_the_readme_names():
    lanes = [line.strip() for line in (ROOT / TEST).read_text().splitlines() if line.strip().startswith("pytest")]
    assert lanes == ['pytest -q -n 2 --dist worksteal -m "not gpu and not slow and not e2e"',
                     'pytest -q -n 2 --dist worksteal -m "e2e and not gpu and not slow"']
    text = " ".join(README.read_text().split())  # the README's prose, line breaks aside
    for lane in lanes:
        assert f"`{lane}" in text, lane


@contextlib.contextmanager
def serve_index(folder: Path):
    """A package index on 127.0.0.1 that holds a torch/ page: what the setup script probes PyTorch's CPU index for."""
    import functools
    import http.server
    import threading

    (folder / "torch").mkdir(parents=True, exist_ok=True)
    (folder / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_readme_install_steps_by_hand_are_what_the_setup_script_runs(tmp_path):
    """The by-hand block is the setup script's commands on a CPU-only machine (its --dry-run, with PyTorch's CPU
    index served locally), and says how to set up: clone, cd, which torch for a CPU and for a GPU machine."""
    by_hand = readme_block("pip install")
    with serve_index(tmp_path) as url:
        out = subprocess.run([str(ROOT / SETUP), "--dry-run", "--cpu"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "TORCH_CPU_INDEX": url}, timeout=60)
    assert out.returncode == 0, out.stderr
    ran = [line[2:].replace(url, "https://download.pytorch.org/whl/cpu") for line in out.stderr.splitlines()
           if line.startswith("+ ")]
    assert [c.replace('"', "") for c in by_hand] == ran
    text = " ".join(README.read_text().split())
    for phrase in ("clone the repository and `cd` into it", "--index-url https://download.pytorch.org/whl/cpu",
                   "a machine with an NVIDIA GPU takes PyPI's `pip install torch==2.13.0`", "On 2 CPU cores it takes"):
        assert phrase in text, phrase


def _user_docs() -> list[Path]:
    """Tracked files under docs/ (docs/results/** aside), README.md and CHANGELOG.md."""
    try:
        out = subprocess.run(["git", "ls-files", "docs", "README.md", "CHANGELOG.md"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.split()
        paths = [ROOT / p for p in out]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        paths = [p for p in (ROOT / "docs").rglob("*") if p.is_file()] + [README, ROOT / "CHANGELOG.md"]
    return [p for p in paths if p.is_file() and not p.relative_to(ROOT).as_posix().startswith("docs/results/")]


def test_user_docs_do_not_narrate_or_cite_missing_files():
    docs = _user_docs()
    assert README in docs
    bad = []
    for path in docs:
        text = path.read_bytes().decode("utf-8", errors="ignore")
        for pattern in (rf"(?i){WORD}", r"METHOD\.md"):
            m = re.search(pattern, text)
            if m:
                line = text.count("\n", 0, m.start()) + 1
                bad.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    assert not bad, f"user docs say {WORD!r} or cite METHOD.md (the method is docs/method.md): " + "; ".join(bad)


# The word that marks an account of how the project was built; spelled in two parts so that this file passes its own
# check. Third-party text shipped as data and raw tool output under docs/results/ may hold it.
WORD = "ses" "sion"
QUOTED = ("headscope/tasks/data/", "headscope/evaluate/data/fidelity/")


def test_no_tracked_file_or_name_narrates_how_the_project_was_built():
    """`git grep -i` for the word finds only third-party text and raw logs; no file or folder name has it."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert not [f for f in files if WORD in f.lower()]
    bad = []
    for f in files:
        if f.startswith(QUOTED) or (f.startswith("docs/results/") and f.endswith(".log")):
            continue
        path = ROOT / f
        if path.suffix in (".safetensors", ".png", ".tgz", ".gz", ".xz") or not path.is_file():
            continue
        text = path.read_bytes().decode("utf-8", errors="ignore")
        m = re.search(rf"(?i){WORD}", text)
        if m:
            bad.append(f"{f}:{text.count(chr(10), 0, m.start()) + 1}")
    assert not bad, f"tracked files that say {WORD!r}: {bad}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])  # headscope, hybrid-train
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])  # python -m research.<...>
    env.setdefault("OMP_NUM_THREADS", "2")
    return env


def _needs_weights():
    from headscope.reference import has_default_weights

    if not has_default_weights():
        pytest.skip("the reference model's weights are not on disk")


# The quick starts in independent groups, so that the e2e lane's workers run them side by side: scoring alone, then
# training and evaluating (the evaluation's second command reads the hybrid that training writes).
GROUPS = {"score": (0,), "train_and_evaluate": (1, 2)}


def test_the_quick_start_groups_cover_every_block():
    assert sorted(i for g in GROUPS.values() for i in g) == list(range(len(quick_start_blocks())))


@pytest.mark.e2e
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_readme_quick_start_commands_run(tmp_path, group):
    """The quick-start ```bash blocks, in order, as written, in a scratch folder that holds the repository files
    the commands name (research/...), so nothing lands in the checkout."""
    _needs_weights()
    quick = [quick_start_blocks()[i] for i in GROUPS[group]]
    for block in quick:
        for rel in re.findall(r"\bresearch/[\w./-]+", block):
            src = ROOT / rel
            if src.is_file():
                (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(src, tmp_path / rel)
    outputs = {o for b in quick for o in re.findall(r"(?:--out|mkdir -p) (\S+)", b)}  # what the commands write
    existed = {o for o in outputs if (ROOT / o).exists()}
    for i, block in zip(GROUPS[group], quick):
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=_env(), capture_output=True,
                           text=True, timeout=1200)
        assert r.returncode == 0, f"README quick-start block {i} failed:\n{block}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert (tmp_path / "mask.json").is_file()
    if group == "train_and_evaluate":
        assert (tmp_path / "runs" / "train_hybrid_tiny" / "hybrid" / "config.json").is_file()
        assert (tmp_path / "results" / "smoke" / "results.json").is_file()
        assert (tmp_path / "results" / "hybrid_smoke" / "results.json").is_file()
    wrote = sorted(o for o in outputs - existed if (ROOT / o).exists())
    assert not wrote, f"the README's commands wrote into the checkout: {wrote}"


@pytest.mark.e2e
def test_readme_python_snippet_runs(tmp_path, monkeypatch):
    _needs_weights()
    monkeypatch.chdir(tmp_path)
    (snippet,) = blocks(README.read_text(), "python")
    ns: dict = {"__name__": "readme_python_block"}
    exec(compile(snippet, "README.md python block", "exec"), ns)
    assert (tmp_path / "mask.json").is_file() and (tmp_path / "student" / "config.json").is_file()
    assert len(ns["mask"].fa_heads) == 8
