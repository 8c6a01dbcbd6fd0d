"""Cheap proxies for the causal head scores, and how well they agree with the exact scores.

    attn = attention_retrieval_score(model, "niah", n_samples=8)   # HeadScores(kind="attention")
    atp = attribution_patching(model, "niah", n_samples=8)         # HeadScores(kind="atp")
    compare_to_exact(atp, exact)                       # {"spearman", "kendall", "topk_overlap", "k"}

``task``: a task name, a Task or a list of TokenizedPair (``headscope.pairs.task_pairs``; the tokenizer is
found from the model unless ``tokenizer=`` is given).

- Attention retrieval: the attention mass that each head puts, from the positions that predict the
  answer (``answer_pos``), on the needle span (``diff_pos``: the prompt positions where the clean and
  corrupted prompts differ), averaged over answer positions. Needs eager attention weights: if the
  model runs another implementation, it is switched to "eager" for the call and switched back.
- Attribution patching (AtP): the first-order estimate of activation patching. With z the heads'
  outputs (the output projection's input), per pair
      M_patched(h) - M_clean ~= sum_{t, d in h} dM/dz[t, d] * (z_corrupt[t, d] - z_clean[t, d])
  and the score is normalized like the receiver score:
      S_atp(h) = -(M_patched(h) - M_clean) / (M_clean - M_corrupt)
  One clean forward+backward and one corrupt forward per pair, whatever the number of heads.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np
import torch
import torch.nn as nn

from headscope.arch import describe
from headscope.hooks import hooks, pre, record_inputs
from headscope.metrics import resolve_metric
from headscope.pairs import task_name, task_pairs
from headscope.results import HeadScores

__all__ = ["attention_retrieval_score", "attribution_patching", "compare_to_exact", "eager_attention"]


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` with attn_implementation="eager" inside the block (so attention weights exist)."""
    before = getattr(model.config, "_attn_implementation", None)
    switch = before not in (None, "eager")
    if switch:
        if not hasattr(model, "set_attn_implementation"):
            raise RuntimeError(f"the model runs attn_implementation={before!r} and cannot be switched; load it with "
                               "attn_implementation='eager' to compute attention proxies")
        model.set_attn_implementation("eager")
    try:
        yield model
    finally:
        if switch:
            model.set_attn_implementation(before)


@torch.no_grad()
def attention_retrieval_score(model: nn.Module, task: Any = "niah", *, tokenizer: Any = None, n_samples: int = 8,
                              seed: int = 0, progress: bool = False, **task_kwargs) -> HeadScores:
    """Attention mass from the answer positions onto the needle span, per head: ``HeadScores(kind="attention")``."""
    from tqdm.auto import tqdm

    arch = describe(model)
    tokenized_pairs = task_pairs(model, task, tokenizer=tokenizer, n_samples=n_samples, seed=seed, **task_kwargs)
    device = next(model.parameters()).device
    rows = []
    with eager_attention(model):
        for p in tqdm(tokenized_pairs, desc="attention proxy", disable=not progress):
            ids = torch.as_tensor(p.clean_ids, dtype=torch.long)[None].to(device)  # [1, T]
            diff = getattr(p, "diff_pos", None)
            diff = (p.clean_ids != p.corrupt_ids).nonzero().flatten() if diff is None else diff  # [P]
            q = torch.as_tensor(p.answer_pos, dtype=torch.long, device=device)  # [A]
            out = model(input_ids=ids, output_attentions=True)
            if out.attentions is None or any(a is None for a in out.attentions):
                raise RuntimeError("the model returned no attention weights even in eager mode")
            attn = torch.stack([a[0] for a in out.attentions])  # [L, H, T, S]
            mass = attn[:, :, q][..., torch.as_tensor(diff, device=device)].sum(-1)  # [L, H, A]
            rows.append(mass.mean(-1).double().cpu())  # [L, H]
    return HeadScores(task=task_name(task, tokenized_pairs), per_sample_raw=torch.stack(rows), kind="attention",
                      n_kv_heads=arch.n_kv_heads, settings={"proxy": "attention_retrieval"})


@contextmanager
def _z_leaves(model: nn.Module) -> Iterator[dict[int, torch.Tensor]]:
    """Every layer's ``z  # [B, T, H*D]`` as a fresh leaf that collects gradients (fed on to the out_proj)."""
    arch = describe(model)
    store: dict[int, torch.Tensor] = {}

    def make_hook(layer: int):
        def hook(module, args):
            store[layer] = args[0].detach().clone().requires_grad_(True)
            return (store[layer],) + tuple(args[1:])
        return hook

    with hooks(pre(proj, make_hook(layer)) for layer, proj in enumerate(arch.out_projs)):
        yield store


def attribution_patching(model: nn.Module, task: Any = "niah", *, tokenizer: Any = None, n_samples: int = 8,
                         seed: int = 0, metric: Any = "logit_diff", denom_eps: float = 1e-4, progress: bool = False,
                         **task_kwargs) -> HeadScores:
    """AtP estimate of every head's receiver score: ``HeadScores(kind="atp")`` (formula in the module docstring).

    ``metric`` must be differentiable: a built-in name ("logit_diff", "logprob"). Pairs whose
    corruption does not change the metric (|M_clean - M_corrupt| <= denom_eps * max(|M_clean|, 1))
    are dropped with a warning, as in exact scoring.
    """
    from tqdm.auto import tqdm

    m = resolve_metric(metric)
    if not m.builtin:
        raise ValueError(f"attribution_patching needs a differentiable built-in metric ('logit_diff' or 'logprob'), "
                         f"got the callable {m.name!r}")
    arch = describe(model)
    tokenized_pairs = task_pairs(model, task, tokenizer=tokenizer, n_samples=n_samples, seed=seed, **task_kwargs)
    device = next(model.parameters()).device
    rows, m_clean, m_corrupt, dropped = [], [], [], []
    for i, p in enumerate(tqdm(tokenized_pairs, desc="attribution patching", disable=not progress)):
        pos = torch.as_tensor(p.answer_pos, dtype=torch.long, device=device)  # [A]
        with torch.no_grad(), record_inputs(arch.out_projs) as z_x:
            lx = model(input_ids=torch.as_tensor(p.corrupt_ids)[None].to(device)).logits[0, pos]  # [A, V]
        mx = float(m(lx, p)[0])
        with torch.enable_grad(), _z_leaves(model) as z_c:
            lc = model(input_ids=torch.as_tensor(p.clean_ids)[None].to(device)).logits[0, pos]  # [A, V]
            mc_t = m(lc, p)[0]
            grads = torch.autograd.grad(mc_t, [z_c[l] for l in range(arch.n_layers)])  # L x [1, T, H*D]
        mc = float(mc_t.detach())
        if abs(mc - mx) <= denom_eps * max(abs(mc), 1.0):
            dropped.append(i)
            continue
        est = torch.stack([
            (g[0] * (z_x[l][0] - z_c[l][0].detach())).view(-1, arch.n_heads, arch.head_dim).sum((0, 2))  # [H]
            for l, g in enumerate(grads)]).double().cpu()  # [L, H]: M_patched - M_clean
        rows.append(-est / (mc - mx))
        m_clean.append(mc)
        m_corrupt.append(mx)
    if not rows:
        raise ValueError("attribution_patching: the corruption does not change the metric on any pair "
                         "(M_clean ~= M_corrupt); corrupt the answer-bearing span or use metric='logprob'")
    if dropped:
        warnings.warn(f"attribution_patching dropped pairs {dropped} whose corruption does not change the metric",
                      stacklevel=2)
    return HeadScores(task=task_name(task, tokenized_pairs), per_sample_raw=torch.stack(rows), kind="atp",
                      n_kv_heads=arch.n_kv_heads, clean_metric=torch.tensor(m_clean, dtype=torch.float64),
                      corrupt_metric=torch.tensor(m_corrupt, dtype=torch.float64),
                      settings={"proxy": "attribution_patching", "metric": m.name, "dropped": dropped})


def compare_to_exact(proxy: HeadScores | torch.Tensor, exact: HeadScores | torch.Tensor, k: int | None = None,
                     use: str = "scores") -> dict[str, float]:
    """Rank agreement of a proxy with the exact scores over all heads.

    ``use``: "scores" (mean of clipped per-sample scores) or "raw" (unclipped mean). Returns
    spearman, kendall (tau-b), topk_overlap (|top-k(proxy) & top-k(exact)| / k) and k (default 5% of heads).
    """
    from scipy.stats import kendalltau, spearmanr

    from headscope.stability import default_k, topk_overlap

    if use not in ("scores", "raw"):
        raise ValueError(f"compare_to_exact: use={use!r} must be 'scores' or 'raw'")

    def flat(x) -> np.ndarray:
        t = getattr(x, use) if isinstance(x, HeadScores) else torch.as_tensor(x, dtype=torch.float64)
        return t.double().flatten().numpy()

    a, b = flat(proxy), flat(exact)
    if a.shape != b.shape:
        raise ValueError(f"compare_to_exact: proxy has {a.size} heads, exact has {b.size}; use scores of one model")
    k = default_k(a.size) if k is None else k
    return {"spearman": float(spearmanr(a, b).statistic), "kendall": float(kendalltau(a, b).statistic),
            "topk_overlap": topk_overlap(a, b, k), "k": k}
