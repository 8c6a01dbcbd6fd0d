"""The public names of both packages are pinned, resolve, and importing them changes nothing."""
import importlib
import subprocess
import sys

import headscope
import hybrid

HEADSCOPE_ALL = [
    "Head", "HeadMask", "HeadScores", "MaskError", "PairError", "PathPatchingResult", "PromptPair",
    "TokenizedPair", "UnknownTaskError", "UnsupportedModelError", "__version__", "ablate_heads", "answer_accuracy",
    "attention_retrieval_score", "attribution_patching", "auc", "combine", "compare_to_exact", "describe", "evaluate",
    "fixed_ratio", "from_pairs", "fuse", "get_task", "iterated_path_patching", "knockout_curve", "knockout_eval",
    "known_models", "kv_group_scores", "layer_similarity", "layerwise", "list_tasks", "load_model",
    "random_global", "random_per_layer", "ranking_stability", "register_backend", "register_task",
    "samples_to_stabilize", "score", "select",
    "sender_scores", "stability_weight", "tokenize_pair",
]
HYBRID_ALL = [
    "HybridCache", "HybridConfig", "HybridConfigError", "HybridForCausalLM", "HybridModel", "HybridOptions",
    "cache_nbytes", "calibrate_merge", "from_layers", "from_mask", "from_teacher", "from_token_level",
    "layerwise_mask", "load", "register", "save", "teacher_cache_nbytes", "StaticHybridCache", "greedy_decode",
]

HYBRID_TRAIN_ALL = [
    "CHECKS", "CheckpointError", "DataConfig", "EvalContext", "MixtureConfig", "MixtureStream", "ModelConfig",
    "RunResult", "STAGES", "Stage", "StageConfig", "TrainConfig", "TrainConfigError", "Trainer", "latest_checkpoint",
    "plot_log", "read_log", "register_check", "register_stage", "run",
]


def test_all_is_pinned():
    train = importlib.import_module("hybrid.train")
    assert sorted(headscope.__all__) == sorted(HEADSCOPE_ALL)
    assert sorted(hybrid.__all__) == sorted(HYBRID_ALL)
    assert sorted(train.__all__) == sorted(HYBRID_TRAIN_ALL)


def test_every_name_resolves():
    for name in headscope.__all__:
        assert getattr(headscope, name) is not None, name
    for name in hybrid.__all__:
        assert getattr(hybrid, name) is not None, name
    train = importlib.import_module("hybrid.train")
    for name in train.__all__:
        assert getattr(train, name) is not None, name


def test_import_is_light_and_registers_nothing():
    """headscope imports nothing heavy; hybrid imports transformers to register its classes with the Auto classes
    (tests/hybrid/test_saving.py checks that this is all it changes) and no kernel or plotting library; nor
    does hybrid.train."""
    code = ("import sys, headscope; heavy = [m for m in ('transformers', 'plotly', 'transformer_lens', "
            "'nnsight', 'fla') if m in sys.modules]; import hybrid, hybrid.train; "
            "heavy += [m for m in ('plotly', 'transformer_lens', 'nnsight', 'fla', 'flash_attn') if m in sys.modules]; "
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
