"""Shared fixtures. The model factories themselves live in model_factories.py (import them by name)."""
from __future__ import annotations

import pytest
import torch

from model_factories import tiny_model


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
