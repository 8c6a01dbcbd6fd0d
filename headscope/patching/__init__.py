"""Activation patching of attention heads: exact receiver scores through several backends.

    engine.py     the generic engine (clean check, normalization) and the naive reference loop
    hf.py         the fast exact path for Hugging Face models (prefix reuse, layer skip, heads as batch)
    tl.py         TransformerLens 4.x TransformerBridge backend (imported lazily)
    nn_sight.py   nnsight backend (imported lazily)
    inputs.py     pair normalization and validation
"""
from headscope.patching.engine import (Backend, CleanFailureError, DegeneratePairError, NaiveBackend,
                                       receiver_scores)
from headscope.patching.hf import HFBackend, HFFastConfig
from headscope.patching.inputs import PatchInputError, PatchPair, as_patch_pair

__all__ = ["Backend", "NaiveBackend", "HFBackend", "HFFastConfig", "receiver_scores", "CleanFailureError",
           "DegeneratePairError", "PatchPair", "PatchInputError", "as_patch_pair"]
