"""Fixtures of the command-line tests."""
import pytest


@pytest.fixture
def no_scoring(monkeypatch):
    """Fail the test if any scoring (receivers, senders, a knockout curve) starts."""
    import headscope.api
    import headscope.knockout
    import headscope.senders

    def boom(*args, **kwargs):
        raise AssertionError("scoring ran although the command line could not succeed")

    monkeypatch.setattr(headscope.api, "score", boom)
    monkeypatch.setattr(headscope.senders, "iterated_path_patching", boom)
    monkeypatch.setattr(headscope.knockout, "knockout_curve", boom)
