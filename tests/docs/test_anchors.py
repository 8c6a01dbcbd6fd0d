"""Every link to a section (`[text](#anchor)`, `[text](file.md#anchor)`) in the README and docs/ lands on a heading
that exists, by GitHub's rule for heading anchors."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors: the heading lowercased, links reduced to their text, every character but letters, digits,
    '_', '-' and spaces dropped, spaces made '-'; a repeated heading gets '-1', '-2', ..."""
    anchors, seen, fenced = set(), {}, False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1).strip().lower())
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_the_anchor_rule_on_headings_of_this_project():
    md = "# Results\n## Past the teacher's context on the CPU: the method's FA branch\n### Decode: `generate()` (x)\n" \
         "```\n# not a heading\n```\n# Results\n"
    assert heading_anchors(md) == {"results", "past-the-teachers-context-on-the-cpu-the-methods-fa-branch",
                                   "decode-generate-x", "results-1"}


def test_every_section_link_lands_on_a_heading():
    links, broken = 0, []
    for doc in DOCS:
        for target, anchor in re.findall(r"\]\(([^)\s#]*)#([^)\s]+)\)", doc.read_text()):
            if target.startswith("http"):
                continue
            links += 1
            path = doc if not target else (doc.parent / target).resolve()
            if not path.exists() or anchor not in heading_anchors(path.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: ({target}#{anchor})")
    assert links > 20, links  # the pattern finds the docs' section links
    assert not broken, "links to a missing section (rename the link or the heading):\n" + "\n".join(broken)
