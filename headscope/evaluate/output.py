"""Result folders: results.json (schema "headscope.evaluation": meta + rows), results.csv, summary.csv,
figures (.html) and the JSONL files of ``df.attrs["artifacts"]`` (e.g. chat_answers.jsonl), written into a
temporary folder beside the target and renamed into place, so a folder is either the old one or the complete
new one, never half-written."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd

from headscope.evaluate.tables import summary
from headscope.io import OutputExistsError, artifact_kind, make_temp_dir, write_text

__all__ = ["check_output_dir", "save_results", "read_results"]

SCHEMA = "headscope.evaluation"


def check_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse a file, or a non-empty folder, unless ``overwrite`` (checked before any work starts)."""
    p = Path(out)
    if p.exists() and not p.is_dir():
        raise OutputExistsError(f"--out {p} is a file; give a folder for the results")
    if p.is_dir() and any(p.iterdir()) and not overwrite:
        what = "holds earlier evaluation results" if artifact_kind(p / "results.json") == SCHEMA \
            else "is not empty (it holds other files)"
        raise OutputExistsError(f"--out {p} {what}; refusing to overwrite it (pass --overwrite / overwrite=True, "
                                "or choose another folder)")
    parent = p.resolve().parent
    if parent.exists() and not os.access(parent, os.W_OK):
        raise PermissionError(f"--out {p}: the folder {parent} is not writable")
    return p


def _clean(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        return _clean(v.item())
    return v


def _clean_record(r: Any) -> Any:
    return {k: _clean(v) for k, v in r.items()} if isinstance(r, dict) else _clean(r)


def save_results(df: pd.DataFrame, out: str | os.PathLike, *, overwrite: bool = False, figures: bool = True,
                 fsync: bool = True) -> Path:
    """Write ``df`` (from ``evaluate``) and its figures into the folder ``out``; returns it. ``fsync=False``: the
    files are not forced to disk one by one (``headscope.io.atomic_write``), for parts saved again later."""
    out = check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_temp_dir(out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        rows = [{k: _clean(v) for k, v in r.items()} for r in df.to_dict("records")]
        meta = dict(df.attrs.get("meta", {}))
        meta["schema"] = SCHEMA
        write_text(tmp / "results.json", json.dumps({**meta, "rows": rows}, indent=1, default=str), fsync=fsync)
        write_text(tmp / "results.csv", df.to_csv(index=False), fsync=fsync)
        write_text(tmp / "summary.csv", summary(df).to_csv(index=False), fsync=fsync)
        for name, records in (df.attrs.get("artifacts") or {}).items():  # e.g. chat_answers.jsonl (fidelity)
            write_text(tmp / Path(name).name, "".join(json.dumps(_clean_record(r), ensure_ascii=False, default=str)
                                                      + "\n" for r in records), fsync=fsync)
        if figures:
            from headscope.evaluate.figures import figures_for

            for stem, fig in figures_for(df).items():
                write_text(tmp / f"{stem}.html", fig.to_html(include_plotlyjs="cdn"), fsync=fsync)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
            os.rmdir(old)
            os.replace(out, old)
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_results(path: str | os.PathLike) -> pd.DataFrame:
    """The DataFrame saved by ``save_results`` (a folder or its results.json), ``attrs["meta"]`` restored."""
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    if artifact_kind(p) != SCHEMA:
        raise ValueError(f"{p} is not a headscope evaluation result (results.json written by headscope eval)")
    data = json.loads(p.read_text(encoding="utf-8"))
    rows = data.pop("rows")
    df = pd.DataFrame(rows)
    df.attrs["meta"] = data
    return df
