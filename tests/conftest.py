"""Shared fixtures. The model factories themselves live in model_factories.py (import them by name)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from model_factories import tiny_model

# Under pytest-xdist (CI runs `-n 2` on 2 cores) each worker and every process it starts computes on one thread:
# two workers with two torch threads each, plus the subprocesses of end-to-end tests, oversubscribe the cores and
# slow torch down several-fold.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# research/ is a package at the repository root, not installed: its scripts run as `python -m research.<name>` from
# the root. Subprocesses that tests start (with or without their own env) find it through PYTHONPATH.
_ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                      if p and p != _ROOT])


@pytest.fixture
def tiny_qwen3():
    return tiny_model("qwen3")


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is faster and immune to other processes on the cores.
    Use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# hybrid.train and research: the reference tokenizer, a tiny Qwen3 teacher saved to disk with it, a mask
@pytest.fixture(scope="package")
def ref_tokenizer():
    from transformers import AutoTokenizer

    from headscope.reference import default_path

    return AutoTokenizer.from_pretrained(default_path(), local_files_only=True)


@pytest.fixture(scope="package")
def tiny_teacher_dir(tmp_path_factory, ref_tokenizer):
    """A 2-layer Qwen3 (4 heads, 2 KV heads, vocab of the reference tokenizer) saved with the tokenizer."""
    from train_factories import save_tiny_teacher

    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"), ref_tokenizer)


@pytest.fixture(scope="package")
def tiny_mask(tiny_teacher_dir, tmp_path_factory):
    from train_factories import save_mask

    return save_mask(tiny_teacher_dir, tmp_path_factory.mktemp("mask") / "mask.json")


# End-to-end tests (CI's second lane, `-m e2e`): whole scripts in subprocesses, the notebook, the docs' snippets, the
# shipped and real models' science. Marked here by path so the list stays in one place; a test may also carry
# @pytest.mark.e2e itself.
E2E = (
    "tests/research/train_hybrid/",
    "tests/research/reference/",
    "tests/research/studies/test_run_studies.py",
    "tests/research/test_bench_",
    "tests/research/test_report_heads.py",
    "tests/research/test_stage_gguf.py",
    "tests/docs/test_quickstart_notebook.py::test_quickstart_runs",
    "tests/docs/test_hybrid_docs.py::test_hybrid_doc_snippets_run",
    "tests/headscope/test_real_model.py",
    "tests/headscope/test_reference.py::test_shipped_",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(E2E):
            item.add_marker(pytest.mark.e2e)
