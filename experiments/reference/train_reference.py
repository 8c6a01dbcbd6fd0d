"""Train the default reference model (Qwen3 architecture, ~7 M params) on text + NIAH + reasoning.

GPU (one H200, ~7 minutes):
    python experiments/reference/train_reference.py --out runs/reference
    python experiments/reference/train_reference.py --out runs/textonly --text-only
CPU smoke / de-risk:
    python experiments/reference/train_reference.py --device cpu --tiny --max-minutes 3 --out /tmp/ref_tiny

Batches are built on the fly by DataLoader workers (experiments/reference/data.py). LR: linear warmup
then cosine, driven by the fraction of the time budget used (or of --max-steps). Writes into --out:
log.jsonl (one JSON line per log step), checkpoint.pt (periodic and on time-out; --resume continues
from it), and at the end the model (fp32 sharded safetensors), tokenizer and train_summary.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import KINDS, MixtureConfig, MixtureStream, describe_mixture, lr_at, tokenize_corpus  # noqa: E402
from head_dropout import head_dropout  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 768
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"ModelConfig.{name} must be > 0, got {value}")


TINY = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            intermediate_size=384)


def build_model(mcfg: ModelConfig, tokenizer, attn_implementation: str = "sdpa"):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=mcfg.vocab_size, hidden_size=mcfg.hidden_size,
                      num_hidden_layers=mcfg.num_hidden_layers, num_attention_heads=mcfg.num_attention_heads,
                      num_key_value_heads=mcfg.num_key_value_heads, head_dim=mcfg.head_dim,
                      intermediate_size=mcfg.intermediate_size, max_position_embeddings=mcfg.max_position_embeddings,
                      rope_parameters={"rope_type": "default", "rope_theta": mcfg.rope_theta},
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      use_cache=True)
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation=attn_implementation, dtype=torch.float32)


def weighted_loss(logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean weighted next-token cross-entropy, the per-row unweighted mean CE ``[B]``, and per-row
    mean CE on answer positions (weight > 1) ``[B]`` (NaN where a row has none)."""
    B, T, V = logits.shape
    ce = F.cross_entropy(logits[:, :-1].float().reshape(-1, V), ids[:, 1:].reshape(-1),
                         reduction="none").view(B, T - 1)  # [B, T-1]
    ww = w[:, :-1]  # [B, T-1]
    loss = (ce * ww).sum() / ww.sum().clamp_min(1.0)
    row = (ce * (ww > 0)).sum(1) / (ww > 0).sum(1).clamp_min(1)  # [B]
    ans = (ce * (ww > 1)).sum(1) / (ww > 1).sum(1)  # [B]
    return loss, row.detach(), ans.detach()


@torch.no_grad()
def probe_accuracy(model, probes: dict, device, autocast) -> dict[str, float]:
    """Greedy answer accuracy on fixed held-out probe sets (cheap progress signal)."""
    from headscope.ablation import answer_accuracy

    model.eval()
    with autocast:
        out = {name: answer_accuracy(model, pairs, batch_size=16) for name, pairs in probes.items()}
    model.train()
    return out


def parse_range(text: str, flag: str) -> tuple[int, int]:
    """"LO-HI" (or "N") -> (LO, HI); a clear error otherwise."""
    try:
        lo, _, hi = text.partition("-")
        return int(lo), int(hi or lo)
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: give LO-HI, e.g. 2-8") from None


def make_probes(tokenizer, seq_len: int, n: int) -> dict:
    from headscope.tasks import get_task

    ctx = max(64, seq_len - 8)
    specs = {f"niah@{seq_len}": ("niah", dict(context_length=ctx, depth="uniform", haystack="heldout"))}
    if seq_len > 256:
        specs["niah@256"] = ("niah", dict(context_length=248, depth="uniform", haystack="heldout"))
    specs["multikey"] = ("niah_multikey", dict(context_length=ctx, depth="random", haystack="heldout", n_keys=4))
    if seq_len > 256:
        specs["multikey@256"] = ("niah_multikey", dict(context_length=248, depth="random", haystack="heldout",
                                                       n_keys=4))
    specs["reasoning"] = ("reasoning", {})
    specs["binding"] = ("binding", {})
    specs["two_hop"] = ("two_hop", {})
    probes = {}
    for i, (label, (name, cfg)) in enumerate(specs.items()):
        try:
            probes[label] = get_task(name, **cfg).tokenized(tokenizer, n, seed=10_001 + i)
        except Exception as err:  # probes are diagnostics only
            print(f"[probe] {label} skipped: {err}", file=sys.stderr)
    return probes


def save_final(model, tokenizer, out: Path) -> None:
    model.config.use_cache = True
    model.save_pretrained(out, max_shard_size="15MB", safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=REPO / "headscope/weights/default",
                    help="folder with tokenizer.json (experiments/reference/train_tokenizer.py)")
    ap.add_argument("--corpus", type=Path, default=REPO / "data/corpus/train.txt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="3 layers, hidden 128, seq 512: a CPU smoke run")
    ap.add_argument("--text-only", action="store_true", help="same model on text only (perplexity reference)")
    ap.add_argument("--max-minutes", type=float, default=7.0, help="training wall-clock budget (set-up excluded)")
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: time budget only)")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--ramp", type=float, default=0.3, help="fraction of the run for the length curriculum")
    ap.add_argument("--tokens-per-batch", type=int, default=None)
    ap.add_argument("--w-text", type=float, default=0.25)
    ap.add_argument("--w-niah", type=float, default=0.4)
    ap.add_argument("--w-multikey", type=float, default=0.15)
    ap.add_argument("--w-reasoning", type=float, default=0.2)
    ap.add_argument("--w-copy", type=float, default=0.1, help="repeated-snippet rows (induction data)")
    ap.add_argument("--answer-weight", type=float, default=5.0)
    ap.add_argument("--haystack-weight", type=float, default=1.0, help="loss weight of NIAH prompt tokens")
    ap.add_argument("--multikey-min-len", type=int, default=0,
                    help="> 0: pack multi-key prompts of lengths from this up to T into each multi-key row")
    ap.add_argument("--reasoning-families", default="arithmetic,binding,comparison,two_hop",
                    help="comma-separated; repeat a family to weight it, e.g. arithmetic,binding,binding")
    ap.add_argument("--extra-queries", type=int, default=0,
                    help="multi-key NIAH and binding examples ask up to this many more keys after the answer")
    ap.add_argument("--binding-vars", default="4-4", help="binding examples bind LO-HI variables (uniform)")
    ap.add_argument("--max-keys", type=int, default=6, help="most keyed needles in a multi-key NIAH prompt")
    ap.add_argument("--fast-niah", action="store_true",
                    help="NIAH prompts around corpus token windows (about the length; 4.2x cheaper, bench_data.py)")
    ap.add_argument("--head-drop", type=float, default=0.0,
                    help="probability of mean-replacing each head's output per row (head_dropout.py)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this saved model folder (e.g. headscope/weights/default) with a fresh optimizer")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=float, default=0.03, help="warmup as a fraction of the run")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (dynamic shapes)")
    ap.add_argument("--log-every", type=int, default=None)
    ap.add_argument("--probe-every", type=int, default=None, help="held-out accuracy probes every N steps")
    ap.add_argument("--probe-n", type=int, default=32)
    ap.add_argument("--ckpt-minutes", type=float, default=2.0)
    ap.add_argument("--resume", action="store_true", help="continue from --out/checkpoint.pt")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    cpu = a.device == "cpu"
    seq_len = a.seq_len or (512 if a.tiny else 2048)
    tokens_per_batch = a.tokens_per_batch or (8 * seq_len if cpu else 32 * seq_len)
    lr = a.lr or (3e-3 if a.tiny else 2e-3)
    workers = a.workers if a.workers is not None else (1 if cpu else 12)
    log_every = a.log_every or (5 if cpu else 25)
    probe_every = a.probe_every or (25 if cpu else 250)
    if cpu:  # one thread: OpenMP barriers on a busy, small CPU cost far more than they give
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    a.out.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    t_setup = time.time()
    tok = AutoTokenizer.from_pretrained(a.tokenizer, local_files_only=True)
    if not a.corpus.exists():
        raise FileNotFoundError(f"{a.corpus} missing: run python experiments/prepare_corpus.py")
    text_ids = tokenize_corpus(tok, a.corpus.read_text(encoding="utf-8"))  # [N]
    mix = MixtureConfig(seq_len=seq_len, tokens_per_batch=tokens_per_batch, w_text=a.w_text, w_niah=a.w_niah,
                        w_multikey=a.w_multikey, w_reasoning=a.w_reasoning, w_copy=a.w_copy,
                        answer_weight=a.answer_weight, haystack_weight=a.haystack_weight,
                        multikey_min_len=a.multikey_min_len, extra_queries=a.extra_queries, fast_niah=a.fast_niah,
                        reasoning_families=tuple(f.strip() for f in a.reasoning_families.split(",") if f.strip()),
                        min_len=min(a.min_len, seq_len), ramp=a.ramp, text_only=a.text_only, seed=a.seed,
                        max_keys=a.max_keys, binding_vars=parse_range(a.binding_vars, "--binding-vars"))
    mcfg = ModelConfig(vocab_size=len(tok), max_position_embeddings=max(2048, seq_len), **(TINY if a.tiny else {}))
    if a.init_from is not None:
        from transformers import AutoModelForCausalLM

        if not (a.init_from / "config.json").exists():
            raise FileNotFoundError(f"--init-from {a.init_from}: no config.json there; give a folder written by "
                                    "this script (or headscope/weights/default)")
        model = AutoModelForCausalLM.from_pretrained(a.init_from, local_files_only=True, dtype=torch.float32,
                                                     attn_implementation="sdpa").to(a.device)
        if model.config.vocab_size != len(tok):
            raise ValueError(f"--init-from {a.init_from}: vocab {model.config.vocab_size} != tokenizer's {len(tok)}; "
                             "give the tokenizer the model was trained with (--tokenizer)")
        mcfg = ModelConfig(**{k: getattr(model.config, k) for k in asdict(mcfg) if k != "rope_theta"},
                           rope_theta=float(model.config.rope_parameters["rope_theta"]))
        print(f"initialised from {a.init_from}", flush=True)
    else:
        model = build_model(mcfg, tok).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f} M params, {mcfg}\ndata: {describe_mixture(mix)}; corpus {len(text_ids)} tokens",
          flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95),
                            fused=not cpu)
    step, elapsed_before, tokens_seen = 0, 0.0, 0
    ckpt_path = a.out / "checkpoint.pt"
    if a.resume:
        if not ckpt_path.exists():
            raise FileNotFoundError(f"--resume: {ckpt_path} does not exist; drop --resume to start fresh")
        ck = torch.load(ckpt_path, map_location=a.device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, elapsed_before, tokens_seen = ck["step"], ck["elapsed"], ck["tokens"]
        print(f"resumed at step {step}, {elapsed_before / 60:.2f} min trained", flush=True)

    progress = mp.Value("d", 0.0)
    stream = MixtureStream(mix, tok, text_ids, progress=progress, rank_seed=a.seed * 1000 + step)
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=workers, pin_memory=not cpu,
                                         prefetch_factor=4 if workers else None, persistent_workers=False)
    probes = {} if a.text_only else make_probes(tok, seq_len, a.probe_n)
    train_model = torch.compile(model, dynamic=True) if a.compile else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if not cpu else torch.autocast("cpu", enabled=False)
    budget = a.max_minutes * 60.0
    log_f = open(a.out / "log.jsonl", "a")
    print(f"set-up {time.time() - t_setup:.1f}s; training for {a.max_minutes} min"
          + (f" or {a.max_steps} steps" if a.max_steps else ""), flush=True)

    def prog(elapsed: float) -> float:
        p = elapsed / budget
        return max(p, step / a.max_steps) if a.max_steps else p

    def checkpoint(elapsed: float) -> None:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "elapsed": elapsed,
                    "tokens": tokens_seen, "args": vars(a) | {"out": str(a.out), "tokenizer": str(a.tokenizer),
                                                               "corpus": str(a.corpus)}}, ckpt_path)

    stop = {"signal": None}  # SIGTERM / SIGINT: finish the step, checkpoint and save, then exit
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda num, frame: stop.__setitem__("signal", num))
    model.train()
    t0 = time.time()
    t_log, tok_log, last_ckpt = t0, 0, t0
    kind_loss = defaultdict(list)
    it = iter(loader)
    with head_dropout(model, a.head_drop):  # hooks on o_proj, active only in train mode
        while True:
            elapsed = elapsed_before + time.time() - t0
            p = prog(elapsed)
            if p >= 1.0 or stop["signal"] is not None:
                break
            progress.value = p
            cur_lr = lr_at(p, lr, a.warmup)
            for g in opt.param_groups:
                g["lr"] = cur_lr
            batch = next(it)
            ids = batch["ids"].to(a.device, non_blocking=True)  # [B, T]
            w = batch["w"].to(a.device, non_blocking=True)  # [B, T]
            with autocast:
                logits = train_model(input_ids=ids).logits  # [B, T, V]
            loss, row, ans = weighted_loss(logits, ids, w)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            tokens_seen += ids.numel()
            tok_log += ids.numel()
            if step % log_every == 0:
                for k, r, r_ans in zip(batch["kind"].tolist(), row.tolist(), ans.tolist()):
                    kind_loss[KINDS[k]].append(r)
                    if r_ans == r_ans:  # not NaN
                        kind_loss[f"{KINDS[k]}_answer"].append(r_ans)
            if step % log_every == 0:
                now = time.time()
                rec = {"step": step, "minutes": round((elapsed_before + now - t0) / 60, 3),
                       "loss": round(loss.item(), 4), "lr": round(cur_lr, 6), "grad_norm": round(float(gnorm), 3),
                       "seq_len": ids.shape[1], "tokens": tokens_seen, "tok_per_s": round(tok_log / (now - t_log))}
                rec |= {f"loss_{k}": round(sum(v) / len(v), 4) for k, v in kind_loss.items() if v}
                if probes and step % probe_every == 0:
                    accs = probe_accuracy(model, probes, a.device, autocast)
                    rec |= {f"acc_{k}": round(v, 3) for k, v in accs.items()}
                print(json.dumps(rec), flush=True)
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                t_log, tok_log = time.time(), 0
                kind_loss = defaultdict(list)
            if time.time() - last_ckpt > a.ckpt_minutes * 60:
                checkpoint(elapsed_before + time.time() - t0)
                last_ckpt = time.time()

    elapsed = elapsed_before + time.time() - t0
    checkpoint(elapsed)
    final = {"step": step, "minutes": round(elapsed / 60, 3), "tokens": tokens_seen, "params": n_params,
             "text_only": a.text_only, "model": asdict(mcfg), "mixture": asdict(mix), "lr": lr,
             "head_drop": a.head_drop, "init_from": str(a.init_from) if a.init_from else None}
    if probes:
        final |= {f"acc_{k}": v for k, v in probe_accuracy(model, probes, a.device, autocast).items()}
    save_final(model, tok, a.out)
    (a.out / "train_summary.json").write_text(json.dumps(final, indent=1))
    print(json.dumps({"final": final}), flush=True)
    log_f.close()
    os._exit(0)  # do not wait for the DataLoader workers to wind down


if __name__ == "__main__":
    main()
