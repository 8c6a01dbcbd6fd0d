"""Tiny Hugging Face models built from configs (no downloads), small enough for CPU unit tests.

Import by plain name (pyproject puts tests/ on the path): `from model_factories import tiny_model`.
"""
from __future__ import annotations

import torch


def tiny_config(family: str = "qwen3", **overrides):
    """A few-layer config of a Hugging Face family, small enough for CPU unit tests."""
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  max_position_embeddings=256)
    if family == "qwen3":
        cfg = tf.Qwen3Config(**common, num_key_value_heads=2, intermediate_size=128, head_dim=16)
    elif family == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=2, intermediate_size=128)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common, num_key_value_heads=2, intermediate_size=128)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, num_key_value_heads=2, intermediate_size=128)
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=256, bos_token_id=0,
                            eos_token_id=0)
    elif family == "gpt_neox":
        cfg = tf.GPTNeoXConfig(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(family: str = "qwen3", seed: int = 0, attn_implementation: str = "eager", dtype=torch.float32,
               **overrides):
    """tiny_config(family, **overrides) as a seeded, randomly initialized model in eval mode."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(family, **overrides)
    model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()


def reference_kv_group_mask(path):
    """A head-mask JSON at ``path`` (returned): FA on KV groups (L0, kv0), (L1, kv3), (L4, kv1), (L6, kv2) of the reference model: 1/8 of its KV heads."""
    from headscope.heads import Head
    from headscope.mask import HeadMask
    from headscope.reference import load_model

    model, _ = load_model()
    heads = [Head(l, 2 * g + r) for l, g in ((0, 0), (1, 3), (4, 1), (6, 2)) for r in range(2)]
    HeadMask.for_model(model, heads).to_json(path)
    return path
