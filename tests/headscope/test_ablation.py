"""headscope.ablation on tiny models: hooks change what they should, and are gone afterwards."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from headscope.ablation import ablate_heads, answer_accuracy, answer_correct, head_means
from headscope.arch import describe
from headscope.heads import Head
from headscope.hooks import record_inputs

from model_factories import tiny_model


def _ids(seed: int = 0, B: int = 2, T: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (B, T), generator=g)  # [B, T]


def _capture_z(model, ids):
    """Inputs of every output projection: list of [B, T, H*D]."""
    arch = describe(model)
    with record_inputs(arch.out_projs) as z:
        logits = model(input_ids=ids).logits
    return [z[l] for l in range(arch.n_layers)], logits


@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_zero_ablation_changes_logits_and_is_removed(family):
    model = tiny_model(family)
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with ablate_heads(model, [Head(1, 2)], kind="zero"):
            during = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.allclose(before, during)
    torch.testing.assert_close(before, after)
    assert all(not p._forward_pre_hooks for p in describe(model).out_projs)


def test_zero_sets_exactly_the_head_slice():
    model = tiny_model("qwen3")
    arch = describe(model)
    ids = _ids()
    with torch.no_grad():
        z_ref, _ = _capture_z(model, ids)
        with ablate_heads(model, [(1, 2)], kind="zero"):
            # a hook registered after ablate_heads' sees the ablated input
            with record_inputs({1: arch.out_projs[1]}) as seen:
                model(input_ids=ids)
    z = seen[1]  # [B, T, H*D]
    sl = arch.head_slice(2)
    assert torch.count_nonzero(z[..., sl]) == 0
    other = torch.ones(z.shape[-1], dtype=torch.bool)
    other[sl] = False
    # layer 1's input is unchanged by an ablation in layer 1 itself, so other heads keep their values
    torch.testing.assert_close(z[..., other], z_ref[1][..., other])


def test_head_means_and_mean_ablation():
    model = tiny_model("qwen3")
    arch = describe(model)
    batches = [_ids(1), _ids(2, B=1, T=7)]
    means = head_means(model, batches)  # [L, H, D]
    assert means.shape == (arch.n_layers, arch.n_heads, arch.head_dim)
    # reference: average of the captured z over all positions
    zs = [(_capture_z(model, b)[0]) for b in batches]
    l, h = 2, 1
    flat = torch.cat([z[l][..., arch.head_slice(h)].reshape(-1, arch.head_dim) for z in zs])  # [N, D]
    torch.testing.assert_close(means[l, h], flat.mean(0), rtol=1e-4, atol=1e-5)
    ids = _ids(3)
    with torch.no_grad():
        base = model(input_ids=ids).logits
        with ablate_heads(model, [(l, h)], kind="mean", values=means):
            mean_abl = model(input_ids=ids).logits
        with ablate_heads(model, [(l, h)], kind="mean", batches=batches):
            mean_abl2 = model(input_ids=ids).logits
    assert not torch.allclose(base, mean_abl)
    torch.testing.assert_close(mean_abl, mean_abl2)


def test_patch_with_own_values_is_identity_and_other_values_change():
    model = tiny_model("qwen3")
    arch = describe(model)
    ids, other = _ids(4), _ids(5)
    with torch.no_grad():
        z_self, base = _capture_z(model, ids)
        z_other, _ = _capture_z(model, other)
        head = Head(0, 3)
        sl = arch.head_slice(head.head)
        with ablate_heads(model, [head], kind="patch", values={head: z_self[0][..., sl]}):
            same = model(input_ids=ids).logits
        with ablate_heads(model, [head], kind="patch", values={head: z_other[0][..., sl]}):
            changed = model(input_ids=ids).logits
    torch.testing.assert_close(base, same)
    assert not torch.allclose(base, changed)


def test_bad_input_errors():
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="kind"):
        with ablate_heads(model, [(0, 0)], kind="bogus"):
            pass
    with pytest.raises(ValueError, match="outside the model"):
        with ablate_heads(model, [(9, 0)]):
            pass
    with pytest.raises(ValueError, match="head_means"):
        with ablate_heads(model, [(0, 0)], kind="mean"):
            pass
    with pytest.raises(ValueError, match="patch"):
        with ablate_heads(model, [(0, 0)], kind="patch"):
            pass


def test_hooks_removed_after_exception():
    model = tiny_model("qwen3")
    with pytest.raises(RuntimeError):
        with ablate_heads(model, [(0, 0), (2, 1)]):
            raise RuntimeError("boom")
    assert all(not p._forward_pre_hooks for p in describe(model).out_projs)


def _pair(ids: torch.Tensor, n_answer: int):
    """A TokenizedPair-like object whose answer is the last n_answer+1 tokens of ids."""
    T = ids.shape[0]
    full = ids
    return SimpleNamespace(clean_ids=full[:-1], answer_pos=torch.arange(T - 1 - n_answer, T - 1),
                           clean_answer_ids=full[T - n_answer:])


def test_answer_accuracy_matches_greedy_decoding():
    model = tiny_model("qwen3")
    prompts = [_ids(10 + i, B=1, T=6 + i)[0] for i in range(5)]
    pairs = []
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = model.generate(p[None], max_new_tokens=3, do_sample=False, pad_token_id=0)[0]  # greedy
        if i % 2:  # make odd pairs wrong: change the last answer token
            out = out.clone()
            out[-1] = (out[-1] + 1) % 128
        pairs.append(_pair(out, 3))
    ok = answer_correct(model, pairs, batch_size=2)  # mixed lengths in one batch: padding must not matter
    assert ok.tolist() == [True, False, True, False, True]
    assert answer_accuracy(model, pairs, batch_size=3) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="no pairs"):
        answer_accuracy(model, [])
