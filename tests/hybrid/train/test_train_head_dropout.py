from __future__ import annotations

import pytest
import torch

import hybrid.train.head_dropout as hd
from model_factories import tiny_model




def test_drop_heads_replaces_whole_head_slices_by_the_batch_mean():
    torch.manual_seed(0)
    B, T, H, D = 6, 5, 4, 3
    z = torch.randn(B, T, H * D)  # [B, T, H*D]
    out = hd.drop_heads(z, H, p=0.5, generator=torch.Generator().manual_seed(1)).view(B, T, H, D)
    zh = z.view(B, T, H, D)
    mean = zh.mean(dim=(0, 1))  # [H, D]
    n_dropped = 0
    for b in range(B):
        for h in range(H):
            if torch.equal(out[b, :, h], zh[b, :, h]):
                continue
            torch.testing.assert_close(out[b, :, h], mean[h].expand(T, D))
            n_dropped += 1
    assert 0 < n_dropped < B * H  # p = 0.5: some but not all (row, head) slices


def test_head_dropout_acts_only_in_train_mode_and_removes_its_hooks():
    model = tiny_model("qwen3")
    ids = torch.randint(0, model.config.vocab_size, (4, 12))  # [B, T]
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits  # [B, T, V]
    with hd.head_dropout(model, p=0.5):
        with torch.no_grad():
            torch.testing.assert_close(model(input_ids=ids).logits, ref)  # eval: untouched
            model.train()
            torch.manual_seed(0)
            dropped = model(input_ids=ids).logits
            model.eval()
    assert not torch.allclose(dropped, ref)
    for layer in model.model.layers:
        assert not layer.self_attn.o_proj._forward_pre_hooks
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref)


@pytest.mark.parametrize("p", [-0.1, 1.0, 2.0])
def test_head_dropout_rejects_bad_probability(p):
    with pytest.raises(ValueError, match="head_dropout p="):
        with hd.head_dropout(tiny_model("qwen3"), p=p):
            pass
