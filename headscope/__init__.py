"""headscope: find the attention heads a model's retrieval and reasoning causally depend on.

    import headscope
    model, tok = headscope.load_model("default")            # the shipped reference model
    scores = headscope.score(model, task="niah")            # exact receiver scores -> HeadScores (tok found)
    mask = headscope.select(scores, ratio="7:1", model=model)     # -> HeadMask; mask.to_json("mask.json")

Names load lazily: importing the package imports neither transformers, plotly, TransformerLens nor nnsight,
and changes nothing in any model.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # values and files
    "Head": "headscope.heads",
    "HeadMask": "headscope.mask",
    "MaskError": "headscope.mask",
    "HeadScores": "headscope.results",
    # models
    "load_model": "headscope.reference",
    "known_models": "headscope.zoo",
    "describe": "headscope.arch",
    "UnsupportedModelError": "headscope.arch",
    # tasks
    "get_task": "headscope.tasks",
    "list_tasks": "headscope.tasks",
    "register_task": "headscope.tasks",
    "from_pairs": "headscope.tasks",
    "tokenize_pair": "headscope.tasks",
    "PromptPair": "headscope.tasks",
    "TokenizedPair": "headscope.tasks",
    "PairError": "headscope.tasks",
    "UnknownTaskError": "headscope.tasks",
    # scoring
    "score": "headscope.api",
    "register_backend": "headscope.patching.backends",
    "sender_scores": "headscope.senders",
    "iterated_path_patching": "headscope.senders",
    "PathPatchingResult": "headscope.senders",
    # fusion and selection
    "combine": "headscope.fusion",
    "fuse": "headscope.fusion",
    "stability_weight": "headscope.fusion",
    "select": "headscope.selection",
    "random_per_layer": "headscope.selection",
    "random_global": "headscope.selection",
    "fixed_ratio": "headscope.selection",
    "layerwise": "headscope.selection",
    "kv_group_scores": "headscope.selection",
    # validation and analysis
    "ablate_heads": "headscope.ablation",
    "answer_accuracy": "headscope.ablation",
    "knockout_curve": "headscope.knockout",
    "knockout_eval": "headscope.knockout",
    "auc": "headscope.knockout",
    "ranking_stability": "headscope.stability",
    "samples_to_stabilize": "headscope.stability",
    "layer_similarity": "headscope.similarity",
    "attention_retrieval_score": "headscope.proxies",
    "attribution_patching": "headscope.proxies",
    "compare_to_exact": "headscope.proxies",
    # evaluation (a callable module: headscope.evaluate(model, suite=...), headscope.evaluate.compare(...))
    "evaluate": "headscope.evaluate",
}
_MODULES = {"evaluate"}  # exported as the module itself

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(_EXPORTS[name])
        value = module if name in _MODULES else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'headscope' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
