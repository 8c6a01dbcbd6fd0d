"""The tables and figure of a study folder (from research/studies/run_studies.py): OUT/tables.md (one markdown
table per study, with the command, seeds and device minutes) and OUT/studies.html (NIAH accuracy by length);
--docs docs/results.md replaces the block between <!-- studies:begin --> and <!-- studies:end --> there (--marker
studies_cpu: between <!-- studies_cpu:begin --> and <!-- studies_cpu:end -->).

    python research/studies/render_studies.py --run runs/studies --out runs/studies/render [--docs docs/results.md]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True, type=Path, help="the study folder")
    ap.add_argument("--out", type=Path, default=None, help="where tables.md and studies.html go (default: RUN)")
    ap.add_argument("--docs", type=Path, default=None, help="a markdown file with the studies markers to fill")
    ap.add_argument("--marker", default="studies",
                    help="the markers <!-- MARKER:begin --> ... <!-- MARKER:end --> of --docs (default studies)")
    ap.add_argument("--command", default=None, help="the command to cite (default: the study's first call's)")
    ap.add_argument("--source", default=None, help="where the raw JSON is kept (cited in the block)")
    a = ap.parse_args(argv)

    from headscope.io import write_text
    from research.studies.runner import StudyError, collect
    from research.studies.metrics import markdown_block, study_figure, update_docs

    try:
        collected = collect(a.run)
    except StudyError as err:
        print(f"render_studies: error: {err}", file=sys.stderr)
        return 2
    out = a.out or a.run
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "studies.json", json.dumps(collected, indent=1, default=str))
    command = a.command or next((c["command"] for c in collected["calls"] if c.get("command")), "?")
    figure = out / "studies.html"
    write_text(figure, study_figure(collected).to_html(include_plotlyjs="cdn"))
    block = markdown_block(collected, command=command, figure=str(figure), source=a.source)
    write_text(out / "tables.md", block)
    print(block)
    if a.docs:
        update_docs(a.docs, block, a.marker)
        print(f"filled {a.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
