"""Load experiments/reference modules by path under unique names (their folder is a script folder, not a package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REF = Path(__file__).resolve().parents[3] / "experiments" / "reference"


def load(name: str):
    key = f"_ref_{name}"
    if key not in sys.modules:
        sys.path.insert(0, str(REF))  # train_reference.py imports its siblings by plain name
        try:
            spec = importlib.util.spec_from_file_location(key, REF / f"{name}.py")
            mod = importlib.util.module_from_spec(spec)
            sys.modules[key] = mod
            spec.loader.exec_module(mod)
        finally:
            sys.path.remove(str(REF))
    return sys.modules[key]


@pytest.fixture(scope="session")
def ref_tokenizer():
    from transformers import AutoTokenizer

    from headscope.reference import default_path

    return AutoTokenizer.from_pretrained(default_path(), local_files_only=True)
