"""The training configuration's error, apart from the config module so that the stages can raise it too (the
config module reads the stage registry; the registry's losses must not import the config back)."""
from __future__ import annotations

__all__ = ["TrainConfigError"]


class TrainConfigError(ValueError):
    """A training configuration that cannot run (the message names the field and the fix)."""
