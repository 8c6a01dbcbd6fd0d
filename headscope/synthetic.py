"""Random-weight models shaped like real ones, and counterfactual pairs for them: benchmark inputs that need no
download (the GPU benchmarks of receiver scoring, sharded scoring and the whole hybrid model).

A random model has no "correct" answer, so a pair's answers are the tokens its corruption moves most, each way:
the clean answer gains the most logit from the corruption's reversal, the corrupt answer from the corruption.
Patching then has a real effect to measure.

    model = random_qwen3(QWEN3_1_7B, device="cuda", dtype=torch.bfloat16)
    pair = moved_answer_pair(model, seq=4096, first_diff=2048, answer=4, generator=torch.Generator().manual_seed(0))
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping

import torch
import torch.nn as nn

__all__ = ["QWEN3_1_7B", "random_qwen3", "moved_answer_pair"]

# Qwen3-1.7B: 28 layers, 16 query / 8 KV heads of 128, hidden 2048, MLP 6144, vocabulary 151936
QWEN3_1_7B = dict(layers=28, heads=16, kv_heads=8, head_dim=128, hidden=2048, intermediate=6144, vocab=151936)
_SHAPE_KEYS = ("layers", "heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab")


def random_qwen3(shape: Mapping[str, int], *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, attn_implementation: str = "sdpa", **config: Any) -> nn.Module:
    """A transformers Qwen3ForCausalLM of ``shape`` (the keys of ``QWEN3_1_7B``; other keys are ignored) with
    weights seeded by ``seed``, built on ``device`` in ``dtype``, in eval mode; tied embeddings, 40960 positions
    unless ``config`` (more Qwen3Config fields) says otherwise."""
    import transformers as tf

    missing = [k for k in _SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"random_qwen3: shape {dict(shape)} lacks {missing}; give every key of QWEN3_1_7B "
                         f"({', '.join(_SHAPE_KEYS)})")
    cfg = tf.Qwen3Config(**{"vocab_size": shape["vocab"], "hidden_size": shape["hidden"],
                            "num_hidden_layers": shape["layers"], "num_attention_heads": shape["heads"],
                            "num_key_value_heads": shape["kv_heads"], "head_dim": shape["head_dim"],
                            "intermediate_size": shape["intermediate"], "max_position_embeddings": 40960,
                            "tie_word_embeddings": True, **config})
    torch.manual_seed(seed)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def moved_answer_pair(model: nn.Module, seq: int, first_diff: int, answer: int, generator: torch.Generator,
                      span: int = 4, shift: int = 7) -> SimpleNamespace:
    """A pair of ``seq`` random tokens (drawn with ``generator``) whose corrupt prompt shifts the ``span`` tokens
    from ``first_diff`` by ``shift`` ids; answers at the last ``answer`` positions, chosen by the model's logit
    change (module docstring). Fields as headscope's pairs: clean_ids, corrupt_ids [T], answer_pos [A],
    clean_answer_ids, corrupt_answer_ids [A] (CPU tensors)."""
    V = model.config.vocab_size
    if not 0 <= first_diff <= seq - span or not 0 < answer <= seq - first_diff - span:
        raise ValueError(f"moved_answer_pair: first_diff={first_diff}, span={span} and answer={answer} do not fit "
                         f"seq={seq}: need first_diff + span <= seq - answer")
    device = next(model.parameters()).device
    clean = torch.randint(0, V, (seq,), generator=generator)  # [T]
    corrupt = clean.clone()  # [T]
    corrupt[first_diff:first_diff + span] = (corrupt[first_diff:first_diff + span] + shift) % V
    with torch.inference_mode():
        lc = model(clean[None].to(device), logits_to_keep=answer).logits[0].float()  # [A, V]
        lx = model(corrupt[None].to(device), logits_to_keep=answer).logits[0].float()  # [A, V]
    return SimpleNamespace(clean_ids=clean, corrupt_ids=corrupt, answer_pos=torch.arange(seq - answer, seq),
                           clean_answer_ids=(lc - lx).argmax(-1).cpu(), corrupt_answer_ids=(lx - lc).argmax(-1).cpu())
