"""HybridForCausalLM: the teacher baseline reproduces the teacher, save/load round trip, generate, errors."""
import subprocess
import sys

import pytest
import torch

from headscope.mask import HeadMask
from hybrid.convert import from_mask
from hybrid.builders import from_teacher
from hybrid.modeling import HybridForCausalLM

from model_factories import tiny_model
from testing_utils import assert_close

FA = [(0, 1), (1, 0), (1, 3), (2, 2)]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2", "mistral"])
def test_teacher_baseline_reproduces_teacher(family):
    teacher = tiny_model(family, dtype=torch.float64)
    ids = torch.randint(0, 128, (2, 13))
    with torch.no_grad():
        # fp32, not fp64_exact: the HF teacher itself runs its RMSNorm and eager softmax in float32
        assert_close(f"{family} logits", from_teacher(teacher)(ids).logits, teacher(ids).logits, "fp32")


def test_forward_shapes_loss_and_hidden_states():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA))
    ids = torch.randint(0, 128, (2, 9))
    out = model(ids, labels=ids, output_hidden_states=True, use_cache=False)
    assert out.logits.shape == (2, 9, 128) and out.hybrid_cache is None
    assert len(out.hidden_states) == 4 and out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.layers[1].self_attn.la.b_proj.weight.grad is not None
    assert model(ids, logits_to_keep=1).logits.shape == (2, 1, 128)


def test_save_load_round_trip(tmp_path):
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA), merge="gated_head", gdn_conv=True)
    with torch.no_grad():  # move new parameters off their init so the round trip is meaningful
        for p in model.new_parameters().values():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = HybridForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.fa_heads == model.config.fa_heads and loaded.config.options == model.config.options
    ids = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    from transformers import AutoModelForCausalLM

    auto = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(auto) is HybridForCausalLM


def test_generate_greedy_matches_manual_loop():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA))
    ids = torch.randint(3, 128, (1, 6))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    seq = ids
    with torch.no_grad():
        for _ in range(5):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


def test_padding_is_rejected():
    teacher = tiny_model("qwen3")
    model = from_mask(teacher, HeadMask.for_model(teacher, FA))
    with pytest.raises(ValueError, match="padding"):
        model(torch.randint(0, 128, (2, 4)), attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))


PAD = 0
PADDED = {  # rows of one batch, no attention_mask
    "right": [[5, 6, 7, 8], [5, 6, PAD, PAD]],
    "left": [[PAD, PAD, 7, 8], [5, 6, 7, 8]],
    "left_uneven": [[PAD, 6, 7, 8], [PAD, PAD, PAD, 8]],
}


@pytest.fixture(scope="module")
def padded_model():
    teacher = tiny_model("qwen3", pad_token_id=PAD)
    return from_mask(teacher, HeadMask.for_model(teacher, FA))


@pytest.mark.parametrize("case", sorted(PADDED))
def test_padded_batch_without_attention_mask_is_refused(padded_model, case):
    with pytest.raises(ValueError, match=r"look padded.*pass attention_mask=torch.ones_like\(input_ids\)"):
        padded_model(torch.tensor(PADDED[case]))


def test_padded_prompt_is_refused_by_generate_too(padded_model):
    """generate() with pad == eos builds an all-ones mask itself; the prompt rows are still checked."""
    with pytest.raises(ValueError, match="look padded|padding"):
        padded_model.generate(torch.tensor(PADDED["left"]), max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                              eos_token_id=PAD)
    with pytest.raises(ValueError, match="look padded|padding"):  # pad != eos: generate's mask has zeros
        padded_model.generate(torch.tensor(PADDED["left"]), max_new_tokens=2, do_sample=False, pad_token_id=PAD,
                              eos_token_id=1)


def test_unpadded_rows_with_pad_ids_pass(padded_model):
    """Not padding: one row, rows that start/end alike, pad ids in the middle, or an explicit all-ones mask."""
    for ids in ([[PAD, 6, PAD, PAD]], [[PAD, 6, 7, PAD], [PAD, 9, 9, PAD]], [[5, PAD, 7, 8], [5, 6, 7, 8]]):
        assert torch.isfinite(padded_model(torch.tensor(ids)).logits).all()
    ids = torch.tensor(PADDED["right"])
    assert torch.isfinite(padded_model(ids, attention_mask=torch.ones_like(ids)).logits).all()


def test_a_single_eos_that_is_also_pad_is_text_two_are_padding():
    """pad == eos (the reference model's choice): one trailing EOS ends a document in packed data and passes;
    runs of two or more that differ between rows are padding."""
    teacher = tiny_model("qwen3", pad_token_id=PAD, eos_token_id=PAD)
    model = from_mask(teacher, HeadMask.for_model(teacher, FA))
    assert torch.isfinite(model(torch.tensor([[5, 6, 7, PAD], [5, 6, 7, 8]])).logits).all()
    with pytest.raises(ValueError, match="look padded"):
        model(torch.tensor([[5, 6, PAD, PAD], [5, 6, 7, 8]]))


def test_import_hybrid_registers_the_auto_classes():
    code = ("from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
            "assert 'headscope_hybrid' not in CONFIG_MAPPING\n"
            "import hybrid\n"
            "assert 'headscope_hybrid' in CONFIG_MAPPING\n"
            "hybrid.register()  # idempotent\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_under_autocast_each_layer_casts_its_normed_input_once(monkeypatch):
    """Under bf16 autocast a hybrid layer's normed input goes to the autocast dtype once for all the Linears that
    read it (hybrid.layers.common.autocast_input), not once per Linear: the same forward values (autocast rounds
    each Linear's input to bf16 either way), gradients within bf16 rounding (the input gradients are summed in
    bf16), and fewer than half the activation-sized casts. Without autocast nothing changes (float32 stays float32)."""
    import hybrid.modeling as modeling
    from headscope.heads import Head
    from torch.profiler import ProfilerActivity, profile

    teacher = tiny_model("llama", num_attention_heads=4, num_key_value_heads=2)
    model = from_mask(teacher, HeadMask.for_model(teacher.config, [Head(0, 1), Head(1, 2)]), check_fingerprint=False)
    model.train()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))  # [B, T]
    C = model.config.hidden_size

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids, use_cache=False).logits  # [B, T, V]
        logits.float().square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    def casts():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            run()
        return sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                   if e.key == "aten::_to_copy" and e.input_shapes and e.input_shapes[0] == [2, 16, C])

    once, once_grads = run()
    n_once = casts()
    monkeypatch.setattr(modeling, "autocast_input", lambda x: x)  # each Linear casts for itself, as before
    each, each_grads = run()
    n_each = casts()
    assert torch.equal(once, each)
    for a, b in zip(once_grads, each_grads):
        assert_close("grad", a, b, "bf16_model")
    assert 2 * n_once < n_each, (n_once, n_each)  # 26 against 72 here (3 layers)
    with torch.no_grad():  # no autocast: float32 in, float32 through
        from hybrid.layers.common import autocast_input

        x = torch.randn(2, 3)
        assert autocast_input(x) is x
