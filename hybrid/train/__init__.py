"""hybrid.train: the three-stage transfer (teacher + head mask -> trained hybrid) and the reference model's
pretraining, in one training loop.

    from hybrid.train import TrainConfig, run
    result = run(TrainConfig.from_file("research/train_hybrid/reference.toml"))
    # or: hybrid-train --config research/train_hybrid/reference.toml [--stage 1|2|3|all] [--resume]

Stages (``STAGES``): "align" (1), "distill" (2), "long" (3), "long_distill" (3), "pretrain". In-run checks
(``CHECKS``, the config's ``eval``; a new one: ``register_check``): "default", "none". Names load lazily.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "run": "hybrid.train.trainer",
    "RunResult": "hybrid.train.trainer",
    "Trainer": "hybrid.train.trainer",
    "TrainConfig": "hybrid.train.config",
    "StageConfig": "hybrid.train.config",
    "DataConfig": "hybrid.train.config",
    "ModelConfig": "hybrid.train.config",
    "TrainConfigError": "hybrid.train.config",
    "STAGES": "hybrid.train.stages",
    "Stage": "hybrid.train.stages",
    "register_stage": "hybrid.train.stages",
    "CHECKS": "hybrid.train.evals",
    "EvalContext": "hybrid.train.evals",
    "register_check": "hybrid.train.evals",
    "CheckpointError": "hybrid.train.checkpoint",
    "latest_checkpoint": "hybrid.train.checkpoint",
    "MixtureConfig": "hybrid.train.data",
    "MixtureStream": "hybrid.train.data",
    "read_log": "hybrid.train.logs",
    "plot_log": "hybrid.train.logs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hybrid.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
