"""docs/results: one folder per run with its README, an index listing every file, and no dangling citation."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
CITING = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "research").rglob("*.md")),
          *sorted((ROOT / "research").rglob("*.py")), *sorted((ROOT / "research").rglob("*.sh")),
          *sorted((ROOT / "hybrid").rglob("*.py")), *sorted((ROOT / "headscope").rglob("*.py")),
          *sorted((ROOT / "tests").rglob("*.py"))]


def test_every_run_folder_has_a_readme_and_is_indexed():
    index = (RESULTS / "README.md").read_text()
    loose = [p.name for p in RESULTS.iterdir() if p.is_file() and p.name != "README.md"]
    assert not loose, f"files outside a run folder: {loose}"
    for run in sorted(p for p in RESULTS.iterdir() if p.is_dir()):
        meta = (run / "README.md").read_text()
        for field in ("made by", "when", "on", "cited by"):
            assert f"**{field}**" in meta, (run.name, field)
        assert f"[{run.name}/]({run.name}/README.md)" in index, run.name
        for f in run.iterdir():
            if f.name != "README.md":
                assert f"`{f.name}`" in index and f"`{f.name}`" in meta, (run.name, f.name)


def test_cited_result_paths_exist():
    cited = set()
    for path in CITING:
        text = path.read_text(errors="ignore").replace('" / "', "/")  # paths written as REPO / "docs" / ...
        cited |= set(re.findall(r"docs/results/([\w.\-/]+\w)", text))
    assert cited, "no doc cites docs/results (the pattern is wrong)"
    missing = sorted(c for c in cited if not (RESULTS / c).exists())
    assert not missing, f"cited but not in docs/results: {missing}"


def _cited(name: str, text: str) -> bool:
    """Cited by name, as the `.log` beside a cited `.json` of the same stem, or by the sweep's brace pattern."""
    stem = name.rsplit(".", 1)[0]
    sweep = re.fullmatch(r"reference_sweep4_(\w+)_log\.jsonl", name)
    return (name in text or f"{stem}.json` / `.log`" in text or f"{stem}.json` and `.log`" in text
            or bool(sweep and re.search(r"reference_sweep4_\{[\w,]*\b" + sweep.group(1) + r"\b[\w,]*\}_log\.jsonl", text)))


def test_every_log_is_cited_somewhere():
    text = "\n".join(p.read_text(errors="ignore") for p in CITING)
    uncited = [f"{f.parent.name}/{f.name}" for f in RESULTS.rglob("*")
               if f.suffix in (".log", ".jsonl") and not _cited(f.name, text)]
    assert not uncited, f"logs no doc cites (delete them or cite them): {uncited}"
