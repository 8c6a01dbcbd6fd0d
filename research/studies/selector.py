"""A learned per-head FA/GDN selector (study 7 of docs/results.md): a gate per head, trained to choose full attention (FA)
or Gated DeltaNet (GDN), whose top gates give a head mask. Seed 002's idea, built here as one more baseline.

    cfg = SelectorConfig(steps=120, batch_size=8, seq_len=2048, budget=1 / 8)
    result = train_selector(teacher, batches, cfg)       # batches: an iterator of token ids [B, T]
    result.gates                                          # [L, H] in (0, 1), a score-like map
    mask = selector_mask(result, teacher, fraction=1 / 8, unit="kv_group")   # settings["strategy"] == "learned"

The model. Every query head h of every layer l gets both branches:
- FA: the teacher's own softmax attention output of that head, exact (``z_fa``, the teacher's o_proj input);
- GDN: a ``hybrid.layers.hybrid_attention.GatedDeltaNetBranch`` over all H heads of the layer, built and copied
  from the teacher exactly as ``hybrid.from_mask`` builds a layer's GDN heads (``hybrid.convert``: q rows, the
  k/v rows of the head's KV group, q/k norms; new beta / decay / conv parameters at their init), normalised per
  head and scaled by gamma as the hybrid's branch merge does (``HybridOptions.merge`` with a norm; gamma calibrated
  to the teacher head's output RMS on the first batch, as ``calibrate_merge`` does before stage 1).
The two are mixed per head before the teacher's output projection:

    z_h = g_h * z_fa_h + (1 - g_h) * z_gdn_h,    g_h = sigmoid(a_h / temperature)

with a_h one learnable scalar per (layer, head) (or per (layer, KV group), ``gate_unit="kv_group"``, shared by the
group's query heads). The gate is static, not a function of the input: seed 002 chose by an argmax over the first
token's router output, which has no gradient (an argmax is piecewise constant), so nothing could learn it; a
static sigmoid gate is differentiable and is what a head mask is (one decision per head for every input).

The loss (one batch), with the teacher frozen:

    loss = mean over layers l of ||o_proj(z_mix) - o_proj(z_fa)||^2 / ||o_proj(z_fa)||^2
           + penalty * (mean(g) - budget)^2

- Layer-local and against the teacher's attention output (o_proj's output), not the layer output: every layer is
  fed the teacher's own input (the output of its input RMSNorm, captured in one teacher forward), so all layers
  train in parallel from one teacher pass and no student forward through the MLPs is needed; the attention output
  is exactly what the mixer replaces (the residual and MLP are the teacher's on both sides and would only add the
  same terms). This is stage 1's per-layer MSE ("align", ``hybrid.train.losses.hidden_mse``) made local to the
  mixer. Each layer's error is relative (divided by the teacher's output energy, no gradient through it): the
  top-k is global over layers, and with an absolute MSE the layers whose attention output is large would take
  the budget for their norm, not for how badly GDN replaces their heads.
- The budget penalty is quadratic around the FA budget, ``penalty * (mean(g) - budget)^2``, not linear
  (``penalty * mean(g)``): a linear penalty has no fixed point at the budget (its pull is the same at any mean,
  so where the gates settle depends on lambda against the reconstruction loss, retuned per model); the
  quadratic one anchors the mean gate at the budget and leaves the ranking, which is all the top-k uses, to the
  reconstruction term. The reconstruction term always pulls a gate up (the teacher's own output is exact); the
  heads whose GDN replacement loses the most pull hardest and keep the highest gates.
- What trains: the gate logits (``gate_lr``), gamma, and the GDN branch's new parameters (beta, decay, convs:
  what stage 1 trains; ``gdn_params="all"`` also trains its q/k/v copied from the teacher) at ``lr``.

Limits (a baseline, not the method): a head whose gate goes to 1 stops training its GDN branch (its gradient is
scaled by 1 - g), so a head that looked bad early stays FA; the gates see the mixture at training length only
(no length extrapolation); the mask is then trained by the same three stages as every other row.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from headscope.configs import from_dict

__all__ = ["SelectorConfig", "SelectorResult", "HeadSelector", "train_selector", "selector_mask",
           "mixture_batches", "GATE_UNITS", "GDN_PARAMS"]

GATE_UNITS = ("head", "kv_group")
GDN_PARAMS = ("new", "all")


@dataclass(frozen=True)
class SelectorConfig:
    """How the selector trains (see the module docstring)."""

    steps: int = 120  # optimizer steps
    batch_size: int = 8  # rows per step
    seq_len: int = 2048  # tokens per row
    lr: float = 2e-3  # GDN parameters and gamma (stage 1's lr)
    gate_lr: float = 5e-2  # gate logits
    penalty: float = 10.0  # lambda of the budget penalty lambda * (mean(g) - budget)^2
    budget: float = 0.125  # the FA share the mean gate is pulled toward (the variant's budget)
    temperature: float = 1.0  # g = sigmoid(a / temperature)
    gate_init: float | None = None  # every gate's value at the start (None: the budget, so the gates start where
    #                                 the penalty holds them and only the reconstruction term separates them)
    gate_unit: str = "head"  # one gate per query head, or per KV group (shared by its query heads)
    gdn_params: str = "new"  # "new": beta / decay / convs (stage 1's); "all": also the GDN q/k/v
    grad_clip: float = 1.0  # max grad norm of the GDN parameters (0: none)
    seed: int = 0
    progress: bool = True  # a tqdm bar over the steps

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SelectorConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("steps", "batch_size", "seq_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(name, "must be an int >= 1")
        if self.seq_len < 2:
            bad("seq_len", "must be >= 2")
        for name in ("lr", "gate_lr", "temperature"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(name, "must be a finite number > 0")
        for name in ("penalty", "grad_clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                bad(name, "must be a finite number >= 0")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 < self.budget <= 1:
            bad("budget", "must be in (0, 1] (the FA share of the heads)")
        g0 = self.gate_init
        if g0 is not None and (isinstance(g0, bool) or not isinstance(g0, (int, float)) or not 0 < g0 < 1):
            bad("gate_init", "must be in (0, 1) (a sigmoid's value), or None (the budget)")
        if self.gate_unit not in GATE_UNITS:
            bad("gate_unit", f"must be one of {GATE_UNITS}")
        if self.gdn_params not in GDN_PARAMS:
            bad("gdn_params", f"must be one of {GDN_PARAMS}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            bad("seed", "must be an int >= 0")
        if not isinstance(self.progress, bool):
            bad("progress", "must be true or false")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SelectorConfig":
        return from_dict(cls, dict(data or {}), where="SelectorConfig")


@dataclass
class SelectorResult:
    """The trained gates ``[L, H]`` (per query head; a KV group's heads share one with gate_unit "kv_group"),
    the per-step history (loss, reconstruction, penalty, mean gate) and the config."""

    gates: torch.Tensor  # [L, H]
    config: SelectorConfig
    n_kv_heads: int
    history: list[dict[str, float]] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # hybrid options, teacher fingerprint, seconds

    def to_dict(self) -> dict[str, Any]:
        return {"gates": self.gates.tolist(), "config": self.config.to_dict(), "n_kv_heads": self.n_kv_heads,
                "history": self.history, "settings": self.settings}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SelectorResult":
        return cls(torch.tensor(data["gates"], dtype=torch.float64), SelectorConfig.from_dict(data["config"]),
                   int(data["n_kv_heads"]), list(data.get("history", [])), dict(data.get("settings", {})))


def _teacher_layers(teacher: nn.Module) -> nn.ModuleList:
    from hybrid.convert import _teacher_parts

    return _teacher_parts(teacher)


class HeadSelector(nn.Module):
    """Both branches on every head of every layer and one gate logit per head (or KV group); see the module
    docstring. The teacher is not a submodule (its weights are never among this module's parameters)."""

    def __init__(self, teacher: nn.Module, cfg: SelectorConfig, options: dict[str, Any] | None = None) -> None:
        super().__init__()
        from hybrid.config import HybridOptions
        from hybrid.convert import _copy_branch, hybrid_config
        from hybrid.layers.common import RotaryEmbedding
        from hybrid.layers.merge import MERGES
        from hybrid.layers.hybrid_attention import GatedDeltaNetBranch

        layers = _teacher_layers(teacher)
        opts = HybridOptions.from_dict({**(options or {}), "granularity": "head", "allow_degenerate": True,
                                        "require_fa_per_layer": False})
        L = len(layers)
        config = hybrid_config(teacher, [[] for _ in range(L)], opts)  # every head GDN: the GDN branch of all heads
        H, K, D, rep = config.num_attention_heads, config.num_key_value_heads, config.head_dim, config.n_rep
        self.cfg, self.options = cfg, opts
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = L, H, K, D
        self.norm = MERGES[opts.merge].norm  # the hybrid's merge normalises GDN heads (norm, gated_*) or not
        self.eps = opts.norm_eps
        heads = list(range(H))
        self.gdn = nn.ModuleList(GatedDeltaNetBranch(config, heads) for _ in range(L))
        p = next(teacher.parameters())
        self.to(device=p.device, dtype=torch.float32)
        with torch.no_grad():
            for branch, t_layer in zip(self.gdn, layers):  # as hybrid.convert.from_mask copies a layer's GDN heads
                _copy_branch(branch, t_layer.self_attn, heads, [h // rep for h in heads], D)
                branch.reset_new_parameters()
        self.rotary = RotaryEmbedding(config)
        self.gamma = nn.Parameter(torch.ones(L, H, device=p.device))  # [L, H]; calibrated on the first batch
        self.calibrated = False
        G = K if cfg.gate_unit == "kv_group" else H
        g0 = min(cfg.budget if cfg.gate_init is None else cfg.gate_init, 1 - 1e-3)  # budget 1 -> 0.999
        a0 = math.log(g0 / (1 - g0)) * cfg.temperature
        self.logits = nn.Parameter(torch.full((L, G), a0, device=p.device))  # [L, G]

    def gates(self) -> torch.Tensor:
        """g = sigmoid(a / temperature) per query head, ``[L, H]``."""
        g = torch.sigmoid(self.logits / self.cfg.temperature)  # [L, G]
        if g.shape[1] != self.n_heads:
            g = g.repeat_interleave(self.n_heads // g.shape[1], dim=1)  # [L, H]: a group's heads share its gate
        return g

    def trainable(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(GDN parameters and gamma, [gate logits])."""
        from hybrid.layers.common import is_new

        gdn = []
        for branch in self.gdn:
            for mname, module in branch.named_modules():
                for pname, prm in module.named_parameters(recurse=False):
                    if self.cfg.gdn_params == "all" or is_new(module, pname, prm):
                        gdn.append(prm)
        return gdn + [self.gamma], [self.logits]

    @torch.no_grad()
    def calibrate(self, z_fa: list[torch.Tensor]) -> None:
        """gamma[l, h] = the teacher head's output RMS (``hybrid.calibrate_merge``'s rule)."""
        from hybrid.layers.merge import output_rms

        for l, z in enumerate(z_fa):  # z  # [B, T, H, D]
            self.gamma[l].copy_(output_rms(z).to(self.gamma))
        self.calibrated = True

    def gdn_heads(self, l: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``l``'s GDN output of every head on the teacher's attention input x [B, T, C]: [B, T, H, D]
        (normalised and scaled by gamma when the merge normalises)."""
        from hybrid.layers.merge import head_rms

        T = x.shape[1]
        positions = torch.arange(T, device=x.device)  # [T]
        cos, sin = self.rotary(positions, x.dtype)  # [T, D] each
        o = self.gdn[l](x, positions, cos, sin, None)  # [B, T, H, D]
        if self.norm:
            o = head_rms(o, self.eps) * self.gamma[l].to(o.dtype)[:, None]  # [B, T, H, D]
        return o

    def loss(self, xs: list[torch.Tensor], z_fa: list[torch.Tensor], o_projs: list[nn.Module]
             ) -> tuple[torch.Tensor, dict[str, float]]:
        """xs[l] [B, T, C] the teacher's attention input, z_fa[l] [B, T, H, D] its per-head attention output,
        o_projs[l] its output projection -> (loss, terms)."""
        if not self.calibrated and self.norm:
            self.calibrate(z_fa)
        g = self.gates()  # [L, H]
        rec = []
        for l, (x, zf, proj) in enumerate(zip(xs, z_fa, o_projs)):
            zg = self.gdn_heads(l, x.float())  # [B, T, H, D] (bf16 under CUDA autocast: fla's kernels)
            with torch.autocast(zg.device.type, enabled=False):  # the error in float32: y - t is small near g = 1
                zf = zf.float()  # [B, T, H, D]
                B, T = zf.shape[:2]
                W = proj.weight.float()  # [C, H*D], frozen
                bias = proj.bias.float() if proj.bias is not None else None
                # o_proj(g zf + (1 - g) zg) - o_proj(zf) = W ((1 - g)(zg - zf)): the bias cancels
                d = (1 - g[l])[:, None] * (zg.float() - zf)  # [B, T, H, D]
                err = F.linear(d.reshape(B, T, -1), W)  # [B, T, C]
                t = F.linear(zf.reshape(B, T, -1), W, bias)  # [B, T, C]: the teacher's attention output
                rec.append(err.pow(2).sum() / t.pow(2).sum().clamp_min(1e-12))
        recon = torch.stack(rec).mean()
        pen = self.cfg.penalty * (g.mean() - self.cfg.budget) ** 2
        loss = recon + pen
        terms = {"loss": loss.item(), "recon": recon.item(), "penalty": pen.item(), "mean_gate": g.mean().item()}
        return loss, terms


def _capture(teacher: nn.Module, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One teacher forward: each layer's attention input (its input RMSNorm's output) [B, T, C] and per-head
    attention output (o_proj's input) [B, T, H, D]."""
    from headscope.arch import describe
    from headscope.hooks import hooks, post, record_inputs

    arch = describe(teacher)
    layers = _teacher_layers(teacher)
    xs: dict[int, torch.Tensor] = {}

    def keep(l: int):
        def fn(module, args, out):
            xs[l] = out.detach()  # [B, T, C]
        return fn

    with torch.no_grad(), record_inputs(arch.out_projs) as z, hooks(
            post(layer.input_layernorm, keep(l)) for l, layer in enumerate(layers)):
        teacher(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)
    H, D = arch.n_heads, arch.head_dim
    return [xs[l] for l in range(arch.n_layers)], [z[l].view(*z[l].shape[:2], H, D) for l in range(arch.n_layers)]


def train_selector(teacher: nn.Module, batches: Iterable[torch.Tensor], cfg: SelectorConfig,
                   options: dict[str, Any] | None = None) -> SelectorResult:
    """Train the gates (and the GDN branches) on ``cfg.steps`` batches of token ids ``[B, T]`` from ``batches``
    (moved to the teacher's device); the teacher is used frozen and left unchanged. ``options``:
    ``hybrid.HybridOptions`` fields of the hybrid the mask is for (decay, convs, merge, backends, seed).
    Deterministic on the CPU for a given ``cfg.seed`` and batches."""
    import time

    from tqdm.auto import tqdm

    from headscope.arch import describe
    from headscope.mask import config_fingerprint

    t0 = time.time()
    device = next(teacher.parameters()).device
    was_training = teacher.training
    teacher.eval()
    flags = [p.requires_grad for p in teacher.parameters()]
    for p in teacher.parameters():
        p.requires_grad_(False)
    devices = [device] if device.type == "cuda" else []
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    history: list[dict[str, float]] = []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(cfg.seed)
            sel = HeadSelector(teacher, cfg, options)
            gdn, gate = sel.trainable()
            opt = torch.optim.AdamW([{"params": gdn, "lr": cfg.lr, "weight_decay": 0.0},
                                     {"params": gate, "lr": cfg.gate_lr, "weight_decay": 0.0}])
            o_projs = list(describe(teacher).out_projs)
            it: Iterator[torch.Tensor] = iter(batches)
            bar = tqdm(range(cfg.steps), desc="selector", disable=not cfg.progress, dynamic_ncols=True)
            for step in bar:
                ids = next(it, None)
                if ids is None:
                    raise ValueError(f"train_selector: the batches ran out after {step} of {cfg.steps} steps")
                ids = ids[:, :cfg.seq_len].to(device)  # [B, T]
                with autocast:
                    xs, z_fa = _capture(teacher, ids)
                    loss, terms = sel.loss(xs, z_fa, o_projs)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip:
                    torch.nn.utils.clip_grad_norm_(gdn, cfg.grad_clip)
                opt.step()
                history.append({"step": step + 1, **{k: round(v, 6) for k, v in terms.items()}})
                bar.set_postfix(loss=f"{terms['loss']:.4f}", gate=f"{terms['mean_gate']:.3f}")
    finally:
        for p, f in zip(teacher.parameters(), flags):
            p.requires_grad_(f)
        teacher.train(was_training)
    gates = sel.gates().detach().double().cpu()  # [L, H]
    settings = {"hybrid": sel.options.to_dict(), "teacher": config_fingerprint(teacher),
                "seconds": round(time.time() - t0, 2), "first": history[0] if history else None,
                "last": history[-1] if history else None}
    return SelectorResult(gates, cfg, sel.n_kv_heads, history, settings)


def selector_mask(result: SelectorResult | torch.Tensor, teacher: nn.Module, *, fraction: float | None = None,
                  ratio: str | float | None = None, k: int | None = None, unit: str = "head",
                  strategy: str = "global", config: SelectorConfig | None = None):
    """The HeadMask of the top gates at a budget: ``headscope.selection.select`` on the gates (so unit
    "head" / "kv_group" and fraction / ratio / k mean what they mean for every strategy; a KV group is ranked by
    the mean of its query heads' gates), ranked by ``strategy`` (a score-using strategy, default "global").
    The settings record strategy "learned", the ranking strategy and the selector's config and last losses."""
    from headscope.selection import STRATEGIES, select

    if not STRATEGIES.entry(strategy).uses_scores:
        raise ValueError(f"selector_mask: strategy={strategy!r} ignores scores; give one that ranks them "
                         f"({[n for n in STRATEGIES if STRATEGIES.entry(n).uses_scores]})")
    gates = result.gates if isinstance(result, SelectorResult) else torch.as_tensor(result)  # [L, H]
    cfg = result.config if isinstance(result, SelectorResult) else config
    mask = select(gates.double(), fraction=fraction, ratio=ratio, k=k, strategy=strategy, unit=unit,
                  kv_reduce="mean", model=teacher)
    settings = {**mask.settings, "strategy": "learned", "ranked_by": strategy,
                "selector": cfg.to_dict() if cfg is not None else None}
    if isinstance(result, SelectorResult):
        settings["selector_result"] = {k2: result.settings.get(k2) for k2 in ("first", "last", "seconds")}
    return replace(mask, settings=settings)


def mixture_batches(data, tokenizer, seq_len: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """Token ids ``[batch_size, seq_len]`` per step, endlessly, from a run's training mixture ``data`` (a
    ``hybrid.train.DataConfig``: the corpus, NIAH, reasoning, ...; ``hybrid.train.data.MixtureStream``, as the
    stages draw theirs; stream "selector", so not a stage's batches). Teacher-sampled rows are left out (the
    selector has no sampled text); the other weights keep their ratios."""
    from types import SimpleNamespace

    from hybrid.train.data import MixtureStream, mixture_config
    from hybrid.train.text import load_corpus

    if data.teacher:
        data = replace(data, teacher=0.0)
    mc = mixture_config(data, SimpleNamespace(seq_len=seq_len, batch_size=batch_size), seed)
    mc = replace(mc, min_len=seq_len, ramp=0.0)  # one length: the selector has no curriculum
    stream = MixtureStream(mc, tokenizer, load_corpus(data.corpus, tokenizer), stage="selector")
    return (stream.batch(step)["ids"] for step in itertools.count())
