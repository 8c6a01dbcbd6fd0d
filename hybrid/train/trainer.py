"""The one training loop: ``run(config)`` trains the stages of ``config`` in order (hybrid.train.STAGES).

Reads top to bottom: set-up (processes, teacher, student, output folder, resume point), then per stage the
trainable parameters, AdamW, the data, and the loop: batch -> loss terms -> backward -> clip -> step, with a
log line every ``log_every`` steps, an evaluation every ``eval_every`` and a checkpoint every
``checkpoint_every`` and at the stage end; finally the trained model is saved (safetensors) with its tokenizer.
"""
from __future__ import annotations


import copy
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from hybrid.train.checkpoint import (CheckpointError, RunRecord, check_run_folder, latest_checkpoint, load_checkpoint,
                                     save_checkpoint, set_rng_state, write_run_record)
from hybrid.train.config import StageConfig, TrainConfig, TrainConfigError
from hybrid.train.distributed import DistEnv, all_reduce_sum, setup, shard, wrap
from hybrid.train.evals import CHECKS, EvalContext
from hybrid.train.logs import JsonlLog, plot_log
from hybrid.train.stages import STAGES, fa_qk_parameter_names, gdn_qkv_parameter_names, new_parameter_names

__all__ = ["run", "RunResult", "Trainer", "CheckpointAndStop"]


class CheckpointAndStop(Exception):
    """Raised by an ``on_step`` callback to stop the run here: the trainer first writes a checkpoint at this step
    (unless it has just written one) and then lets the exception through, so ``resume=True`` continues from exactly
    this step and no step is trained twice or lost (a time-limited machine: ``research/train_hybrid/run.py
    --stop-after``)."""


@dataclass
class RunResult:
    out: Path
    model_path: Path | None  # the saved hybrid (OUT/hybrid) or model (OUT/model)
    history: list[dict[str, Any]] = field(default_factory=list)  # the log records of this call
    model: nn.Module | None = None  # the trained model (unwrapped)


class _Clock:
    """Progress of a stage in [0, 1]: steps done / steps, or with ``max_minutes`` the larger of that and the
    fraction of the time budget used (agreed by all processes). The first step a process runs in a stage is
    not counted (``start_after_warmup``): it holds kernel compilation and autotuning (fla's first call took
    minutes on a bare H200), which would otherwise eat a short stage's budget; its time is logged instead."""

    def __init__(self, s: StageConfig, elapsed_before: float, env: DistEnv) -> None:
        self.s, self.before, self.env, self.t0 = s, elapsed_before, env, time.time()

    def elapsed(self) -> float:
        return self.before + time.time() - self.t0

    def start_after_warmup(self) -> float:
        """Restart the budget's clock after the warm-up step; returns that step's seconds."""
        now = time.time()
        warm, self.t0 = now - self.t0, now
        return warm

    def progress(self, step: int) -> float:
        p = step / self.s.steps
        if self.s.max_minutes:
            used = torch.tensor([self.elapsed() / (60.0 * self.s.max_minutes)])
            if self.env.world > 1:
                import torch.distributed as dist

                dist.all_reduce(used, op=dist.ReduceOp.MAX)
            p = max(p, float(used))
        return min(p, 1.0)


def run(config: TrainConfig | str | Path, *, stage: str | int = "all", resume: bool = False,
        allow_config_change: bool = False, evaluate: Callable[[EvalContext], dict] | None = None,
        on_step: Callable[[str, int], None] | None = None) -> RunResult:
    """Train ``config`` (a TrainConfig or a config file). ``stage``: "all" or a stage number (1-based, in the
    config's order) to run that stage only (stage > 1 continues from the folder's checkpoint of the stage
    before). ``resume``: continue from the newest checkpoint in ``config.out``. ``evaluate``: a callable
    replacing ``config.eval``. ``on_step(stage_name, steps_done)`` is called after every optimizer step
    (tests use it to kill a run); raising ``CheckpointAndStop`` from it checkpoints this step, then stops."""
    if not isinstance(config, TrainConfig):
        config = TrainConfig.from_file(config)
    return Trainer(config, evaluate=evaluate, on_step=on_step).run(stage, resume, allow_config_change)


class Trainer:
    def __init__(self, config: TrainConfig, evaluate=None, on_step=None) -> None:
        self.config = config
        self.evaluate = evaluate if evaluate is not None else CHECKS[config.eval]
        self.on_step = on_step
        self.history: list[dict[str, Any]] = []
        self._corpus: dict[tuple, Any] = {}  # hybrid.train.text.load_text's memo (text_key -> ids or TextSources)
        self._eval_cache: dict = {}
        self._last = -1  # the last stage index of this run
        # the next stage's data, made at this stage's start: index, loader, setup_s, progress, and its batches
        # (None until start_next_workers started its workers)
        self._next: dict[str, Any] | None = None
        self._mw = None  # the stage's MasterWeights while one trains with bf16 working weights
        self.loss_teacher = None  # the teacher the stage losses run (a compiled copy with compile_teacher)

    # ---- set-up ----------------------------------------------------------------------------
    def run(self, stage: str | int, resume: bool, allow_config_change: bool) -> RunResult:
        cfg = self.config
        t_run = time.time()
        only = self._stage_index(stage)
        if only is not None and only > 0:
            resume = True  # a later stage alone continues from the earlier stages' checkpoint
        self._preflight()  # before any model is loaded
        env = self.env = setup(cfg.device, cfg.distributed)
        if cfg.threads and env.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        out = Path(cfg.out)
        torch.manual_seed(cfg.seed)  # the same initial model on every process
        self.teacher, self.mask = None, None
        from hybrid.train.build import (build_hybrid, build_pretrain_model, identity, load_teacher,
                                        load_tokenizer)

        if cfg.is_hybrid:
            self.teacher, self.tokenizer = load_teacher(cfg.teacher, env.device, cfg.tokenizer)
            self.student, self.mask = build_hybrid(self.teacher, cfg.mask, cfg.hybrid)
            for st in cfg.stages:  # what needs the teacher refused now, not after the earlier stages trained
                if STAGES[st.name].for_teacher is not None and STAGES[st.name].uses_teacher:
                    STAGES[st.name].for_teacher(st, self.teacher)
            if cfg.teacher_dtype != "float32":  # after the student copied the teacher's float32 weights
                from hybrid.train.precision import WORKING_DTYPES, cast_parameters

                cast_parameters(self.teacher, WORKING_DTYPES[cfg.teacher_dtype])  # not its rotary buffers
        else:
            from headscope.reference import DEFAULT_NAME

            tok_src = cfg.tokenizer or cfg.model.init_from or DEFAULT_NAME
            self.tokenizer = load_tokenizer(tok_src)
            self.student = build_pretrain_model(cfg.model, self.tokenizer, env.device)
        record = RunRecord(identity(cfg, self.teacher, self.mask, self.tokenizer), cfg.fingerprint(), cfg.to_dict())
        if only is not None and only > 0 and latest_checkpoint(out) is None:
            raise CheckpointError(f"--stage {only + 1}: stage 1 is not finished in {out} (no checkpoint); run the "
                                  "earlier stages first (--stage 1 or --stage all)")
        ckpt = check_run_folder(out, record, resume, allow_config_change)  # every process checks (same answer)
        self._check_corpus_sizes(len(cfg.stages) - 1 if only is None else only)  # before the run folder is made
        env.barrier()
        if env.is_main:
            out.mkdir(parents=True, exist_ok=True)
            write_run_record(out, record)
        self.log = JsonlLog(out / "log.jsonl", enabled=env.is_main)
        start_index, start_step, train_state = 0, 0, None
        if ckpt is not None:
            tensors, train_state, rng = load_checkpoint(ckpt, env.rank)
            self.student.load_state_dict(tensors, strict=True)
            start_index, start_step = ckpt.stage_index, ckpt.step
            s0 = cfg.stages[start_index]
            if start_step >= s0.steps or (ckpt.done and s0.max_minutes):  # that stage is finished (this config)
                start_index, start_step, train_state = start_index + 1, 0, None
            self.log.write({"event": "resume", "from": ckpt.path.name, "stage_index": start_index,
                            "step": start_step})
        else:
            rng = None
            if cfg.is_hybrid and cfg.calibrate_merge:
                self._calibrate_merge()
        if only is not None:
            if start_index > only:
                raise CheckpointError(f"--stage {only + 1}: {out} already finished that stage (latest checkpoint "
                                      f"{ckpt.path.name}); run a later stage or choose another output folder")
            if start_index < only:
                raise CheckpointError(f"--stage {only + 1}: stage {start_index + 1} is not finished in {out}; run "
                                      f"the earlier stages first (--stage {start_index + 1} or --stage all)")
        # the student only, after calibration (eager) and before DDP wraps it; not the teacher, which also samples
        # text (generate: a new shape at every decode step)
        if cfg.compile:
            from hybrid.train.build import compile_decoder_layers

            self.log.write({"event": "compile", "layers": compile_decoder_layers(self.student)})
        self.loss_teacher = self.teacher  # what the stage losses run
        if cfg.compile_teacher and self.teacher is not None:
            from hybrid.train.build import compile_decoder_layers

            self.loss_teacher = copy.deepcopy(self.teacher).requires_grad_(False)
            self.log.write({"event": "compile_teacher", "layers": compile_decoder_layers(self.loss_teacher)})
        torch.manual_seed(cfg.seed * 1000 + env.rank)  # per-process randomness (head dropout)
        if rng is not None:
            set_rng_state(rng)
        shard(self.student, env)
        if self.teacher is not None:
            shard(self.teacher, env)
        last = self._last = len(cfg.stages) - 1 if only is None else only
        self.log.write({"event": "setup", "seconds": round(time.time() - t_run, 2)})  # models, tokenizer, resume
        try:
            for i in range(start_index, last + 1):
                self.train_stage(i, cfg.stages[i], start_step if i == start_index else 0,
                                 train_state if i == start_index else None)
        finally:
            self.log.close()
        model_path = None
        if env.is_main or env.mode == "fsdp":
            model_path = self.save_final(out)
        if env.is_main:
            try:
                plot_log(out / "log.jsonl", out / "training.html")
            except ModuleNotFoundError as e:  # a figure is not worth a finished run (the GPU image has no plotly)
                warnings.warn(f"no {out / 'training.html'}: {e} (pip install plotly; hybrid.train.plot_log redraws "
                              "it from log.jsonl)", stacklevel=1)
        env.barrier()
        return RunResult(out, model_path, self.history, self.student)

    def _preflight(self) -> None:
        """What can be refused before loading a model: a device that is not there, an output path that is a
        file or cannot be written."""
        from hybrid.train.checkpoint import check_output_folder

        if self.config.device == "cuda" and not torch.cuda.is_available():
            raise TrainConfigError("device='cuda' but no CUDA GPU is visible (torch.cuda.is_available() is False): "
                                   "pass --device cpu or --device auto (device = \"cpu\" / \"auto\" in the config)")
        check_output_folder(Path(self.config.out))

    def _check_corpus_sizes(self, last: int) -> None:
        """Refuse a text corpus shorter than one window of a stage that cuts windows from it (text or copy rows;
        the merge calibration reads the first stage's), naming its size and the size needed."""
        from hybrid.config import HybridOptions
        from hybrid.layers.merge import MERGES
        from hybrid.train.text import load_text

        cfg = self.config
        calibrates = cfg.is_hybrid and cfg.calibrate_merge and MERGES[HybridOptions.from_dict(cfg.hybrid).merge].norm
        for i, s in enumerate(cfg.stages[: last + 1]):
            d = cfg.data_for(s)
            need = s.seq_len + 2 if (d.text > 0 or d.copy > 0) else 0
            if i == 0 and calibrates:
                need = max(need, min(512, s.seq_len) + 1)
            if not need:
                continue
            text = load_text(d, self.tokenizer, self._corpus)  # memoised: the stage reuses it
            sizes = text.sizes() if hasattr(text, "sizes") else {d.corpus: int(text.numel())}
            short = {name: n for name, n in sizes.items() if n < need}
            if short:
                got = ", ".join(f"{name!r} has {n} tokens" for name, n in short.items())
                raise TrainConfigError(
                    f"stages[{s.name}]: the text corpus is too short ({got}); one window of seq_len={s.seq_len} "
                    f"needs at least {need} tokens: give a longer data.corpus, a shorter seq_len, or data.text = "
                    "data.copy = 0 and calibrate_merge = false")

    def _stage_index(self, stage: str | int) -> int | None:
        if stage in ("all", None):
            return None
        try:
            i = int(stage)
        except (TypeError, ValueError):
            raise TrainConfigError(f"stage={stage!r}: give 'all' or a stage number "
                                   f"1..{len(self.config.stages)}") from None
        if not 1 <= i <= len(self.config.stages):
            raise TrainConfigError(f"stage={stage}: this config has stages 1..{len(self.config.stages)} "
                                   f"({', '.join(s.name for s in self.config.stages)})")
        return i - 1

    # ---- one stage -------------------------------------------------------------------------
    def trainable(self, stage_cfg: StageConfig) -> list[tuple[str, nn.Parameter]]:
        """Set requires_grad for the stage and return the trained (name, parameter)s."""
        stage = STAGES[stage_cfg.name]
        new = new_parameter_names(self.student) if stage.trains == "new" else None
        if new is not None and not new:
            raise TrainConfigError(f"stage {stage_cfg.name!r} trains the new parameters, and the model has none")
        if new is not None and stage_cfg.train_gdn_qkv:  # the GDN heads' q/k/v copied from the teacher too
            new = new | gdn_qkv_parameter_names(self.student)
        if new is not None and stage_cfg.train_fa_qk:  # the FA heads' q/k, which NoPE changes the use of
            new = new | fa_qk_parameter_names(self.student)
        out = []
        for n, p in self.student.named_parameters():
            p.requires_grad_(new is None or n in new)
            if p.requires_grad:
                out.append((n, p))
        return out

    def optimizer(self, params: list[tuple[str, nn.Parameter]], s: StageConfig) -> torch.optim.Optimizer:
        decay = [p for n, p in params if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]
        no_decay = [p for n, p in params if not (p.dim() >= 2 and not getattr(p, "_no_weight_decay", False))]
        groups = [g for g in ({"params": decay, "weight_decay": s.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        fused = self.env.device.type == "cuda" and self.env.mode != "fsdp"
        return torch.optim.AdamW(groups, lr=s.lr, betas=tuple(s.betas), fused=fused or None)

    def stage_data(self, index: int, s: StageConfig, start: int) -> tuple[Any, dict[str, float], Any]:
        """An iterator over this process's batches of steps start.. of stage ``index``, the seconds its set-up
        spent (corpus, teacher samples, total; logged with stage_start), and the shared value through which the
        trainer tells the data workers the stage's progress. The data made during the stage before is used when
        there is some; and the next stage's data (its teacher samples, its loader) is made now, its workers started
        after this stage's first step (``start_next_workers``): a spawned data worker imports torch, transformers
        and the project before its first batch, 17-18 s per stage on the H200, which then overlaps training."""
        made, self._next = self._next, None
        if made is not None and made["index"] == index and start == 0:
            batches = made["batches"] if made["batches"] is not None else iter(made["loader"])
            setup_s, progress = {**made["setup_s"], "made_during_stage_before": True}, made["progress"]
        else:
            loader, setup_s, progress = self._loader(index, s, start)
            batches = iter(loader)
        nxt = index + 1
        if nxt <= self._last and self.config.data_for(self.config.stages[nxt]).workers:
            loader, nxt_setup, nxt_progress = self._loader(nxt, self.config.stages[nxt], 0)
            self._next = {"index": nxt, "loader": loader, "setup_s": nxt_setup, "progress": nxt_progress,
                          "batches": None}
        return batches, setup_s, progress

    def _calibrate_merge(self, rows: int = 4, length: int = 512) -> None:
        """A fresh hybrid's merge gammas = the teacher's per-head output RMS (``hybrid.calibrate_merge``) on
        ``rows`` consecutive windows at the start of the first stage's corpus; nothing for a merge without gamma."""
        from hybrid.config import HybridOptions
        from hybrid.layers.merge import MERGES, calibrate_merge
        from hybrid.train.text import load_text

        if not MERGES[HybridOptions.from_dict(self.config.hybrid).merge].norm:
            return
        t0 = time.time()
        s = self.config.stages[0]
        d = self.config.data_for(s)
        T = min(length, s.seq_len)
        text = load_text(d, self.tokenizer, self._corpus)
        ids = getattr(text, "ids", text)  # [N] (weighted sources: all of them, concatenated)
        n = min(rows, max(1, (ids.numel() - 1) // T))
        x = ids[: n * T].reshape(n, T).long().to(self.env.device)  # [n, T]
        gamma = calibrate_merge(self.student, self.teacher, x)  # [L, H]
        self.log.write({"event": "calibrate_merge", "tokens": n * T, "gamma_min": round(gamma.min().item(), 4),
                        "gamma_max": round(gamma.max().item(), 4), "seconds": round(time.time() - t0, 2)})

    def start_next_workers(self) -> None:
        """Start the next stage's data workers (made by ``stage_data``), once."""
        if self._next is not None and self._next["batches"] is None:
            self._next["batches"] = iter(self._next["loader"])

    def _loader(self, index: int, s: StageConfig, start: int) -> tuple[Any, dict[str, float], Any]:
        from hybrid.train.data import MixtureStream, StepBatches, mixture_config
        from hybrid.train.text import load_text, sample_teacher

        d = self.config.data_for(s)
        t0 = time.time()
        text = load_text(d, self.tokenizer, self._corpus)  # ids [N], or TextSources (a corpus manifest)
        setup_s = {"corpus": round(time.time() - t0, 2)}
        teacher_ids = None
        if d.teacher > 0:
            if self.teacher is None:
                raise TrainConfigError(f"stages[{s.name}].data.teacher={d.teacher}: teacher-sampled text needs a "
                                       "teacher (hybrid stages only)")
            # short rows in one batch: sampling a whole seq_len row per sample cost ~100 s per stage start on the
            # H200 (sequential decode steps); windows of seq_len are cut across the concatenated rows instead
            n_rows = max(d.teacher_samples, -(-(s.seq_len + 2) // d.teacher_sample_len))
            teacher_ids = sample_teacher(self.teacher, self.tokenizer, n_rows, d.teacher_sample_len,
                                         d.teacher_temperature, seed=self.config.seed * 7919 + index,
                                         batch_size=n_rows)
            setup_s["teacher_samples"] = round(time.time() - t0 - setup_s["corpus"], 2)
        stream = MixtureStream(mixture_config(d, s, self.config.seed), self.tokenizer, text,
                               stage=f"{index}:{s.name}", teacher_ids=teacher_ids)
        import multiprocessing as mp

        # the stage's progress, read by the data workers (made in the context that starts them)
        progress = mp.get_context("spawn").Value("d", start / s.steps)
        ds = StepBatches(stream, start, s.steps, s.steps, self.env.rank, self.env.world,
                         progress=progress if s.max_minutes else None)
        # spawn, never fork: a child forked from this process (CUDA, tqdm and torch threads) can inherit a held
        # lock and hang; the evaluation harness's prompt workers stalled that way on the H200 (docs/evaluation.md)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=d.workers,
                                             multiprocessing_context="spawn" if d.workers else None,
                                             prefetch_factor=4 if d.workers else None,
                                             pin_memory=self.env.device.type == "cuda")
        setup_s["total"] = round(time.time() - t0, 2)
        return loader, setup_s, progress

    def train_stage(self, index: int, s: StageConfig, start: int, train_state: dict | None) -> None:
        from hybrid.train.precision import WORKING_DTYPES, MasterWeights

        params = self.trainable(s)
        dtype = WORKING_DTYPES[self.config.working_dtype]  # bf16 working weights: cast before DDP wraps the model
        mw = self._mw = MasterWeights(self.student, dtype) if dtype != torch.float32 else None
        try:
            self._train_stage(index, s, start, train_state, params, mw)
        finally:
            if mw is not None:
                mw.close()  # the float32 masters back in the model (the next stage, the final save)
            self._mw = None

    def _train_stage(self, index: int, s: StageConfig, start: int, train_state: dict | None, params, mw) -> None:
        cfg, env = self.config, self.env
        stage = STAGES[s.name]
        model = wrap(self.student, env)
        opt_params = mw.masters_for(params) if mw is not None else params  # what AdamW updates and clips
        opt = self.optimizer(opt_params, s)
        if train_state is not None:
            self._load_optimizer(opt, train_state["optimizer"])
        teacher = self.loss_teacher if stage.uses_teacher else None
        if stage.for_teacher is not None and teacher is not None:  # e.g. long_distill's kl_positions = 0 resolved
            s = stage.for_teacher(s, teacher)
        batches, setup_s, shared_progress = self.stage_data(index, s, start)
        autocast = env.autocast()
        from contextlib import nullcontext

        from hybrid.train.head_dropout import head_dropout
        from tqdm.auto import tqdm

        bar = tqdm(total=s.steps, initial=start, desc=f"stage {index + 1}/{len(cfg.stages)} {s.name}", unit="step",
                   disable=not (cfg.progress and env.is_main), dynamic_ncols=True)
        n_trained = sum(p.numel() for _, p in params)
        self.log.write({"event": "stage_start", "stage": s.name, "stage_index": index, "step": start,
                        "trainable_params": n_trained, "seq_len": s.seq_len, "batch_size": s.batch_size,
                        **({"kl_positions": s.kl_positions} if s.kl_positions else {}),
                        "setup_seconds": setup_s})
        self.student.train()
        if env.device.type == "cuda":  # gpu_mem_gib in the log: this stage's peak, not an earlier stage's
            torch.cuda.reset_peak_memory_stats(env.device)
        t_log, tok_log = time.time(), 0
        tokens = train_state.get("tokens", 0) if train_state else 0
        clock = _Clock(s, train_state.get("elapsed", 0.0) if train_state else 0.0, env)
        dropout = head_dropout(self.student, s.head_drop) if s.head_drop else nullcontext()
        step = start
        progress = clock.progress(step)  # steps done (or time used) as a fraction of the stage
        with dropout:
            while progress < 1.0:
                shared_progress.value = progress
                lr = s.lr_at(progress * s.steps if s.max_minutes else step)
                for g in opt.param_groups:
                    g["lr"] = lr
                t_batch = time.time()
                batch = next(batches)
                if step == start:
                    first_batch_s = time.time() - t_batch  # includes the data workers' start
                ids = batch["ids"].to(env.device, non_blocking=True)  # [b, T]
                w = batch["w"].to(env.device, non_blocking=True)  # [b, T]
                opt.zero_grad(set_to_none=True)  # with master weights: the masters' (the working copies' were freed)
                terms, counts = self._forward_backward(stage, s, model, teacher, ids, w, autocast)
                if mw is not None:
                    mw.grads_to_master()
                gnorm = torch.nn.utils.clip_grad_norm_([p for _, p in opt_params], s.grad_clip or math.inf)
                opt.step()
                if mw is not None:
                    mw.master_to_model()
                step += 1
                n_tok = ids.numel() * env.world
                tokens += n_tok
                tok_log += n_tok
                if step == start + 1:  # compilation + autotuning: logged, not counted in max_minutes or tok/s
                    self.log.write({"event": "warmup_step", "stage": s.name, "stage_index": index, "step": step,
                                    "seconds": round(clock.start_after_warmup(), 2),
                                    "first_batch_seconds": round(first_batch_s, 2)})
                    t_log, tok_log = time.time(), 0
                    self.start_next_workers()  # after the first step's compilation: it overlaps the rest
                progress = clock.progress(step)
                stage_end = progress >= 1.0
                if stage_end and step < s.steps and env.is_main:  # the time cap ended it: not the recipe's tokens
                    self.log.write({"event": "stage_capped", "stage": s.name, "stage_index": index, "step": step,
                                    "steps": s.steps, "max_minutes": s.max_minutes})
                    warnings.warn(f"stage {s.name} stopped by its max_minutes={s.max_minutes:g} at step {step} of "
                                  f"{s.steps}: it trained {step / s.steps:.0%} of its steps, so the run is not the "
                                  "recipe's (a slower or shared machine); raise max_minutes to train every step",
                                  stacklevel=1)
                if step % cfg.log_every == 0 or stage_end:
                    sums = all_reduce_sum(torch.stack([t.detach().float() for _, _, t, _ in terms]), env)
                    now = time.time()
                    rec = {"stage": s.name, "stage_index": index, "step": step,
                           "loss": float(sum(wt * sums[j] / counts[j] for j, (_, wt, _, _) in enumerate(terms))),
                           **{f"loss_{name}": float(sums[j] / counts[j]) for j, (name, *_) in enumerate(terms)},
                           "lr": lr, "grad_norm": float(gnorm), "seq_len": ids.shape[1], "tokens": tokens,
                           "tok_per_s": round(tok_log / max(now - t_log, 1e-9), 1),
                           "minutes": round(clock.elapsed() / 60, 3)}
                    if env.device.type == "cuda":  # this process's peak in this stage (DDP/FSDP ranks are alike)
                        rec["gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(env.device) / 2**30, 2)
                    self._record(rec)
                    bar.set_postfix(loss=f"{rec['loss']:.4g}", tok_s=f"{rec['tok_per_s']:.3g}")
                    t_log, tok_log = now, 0
                bar.update(1)
                if (cfg.eval_every and step % cfg.eval_every == 0) or stage_end:
                    self.run_eval(index, s, step)
                wrote = bool((cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stage_end)
                if wrote:
                    self.checkpoint(index, s, step, opt, tokens, stage_end, clock.elapsed())
                if self.on_step is not None:
                    try:
                        self.on_step(s.name, step)
                    except CheckpointAndStop:
                        if not wrote:  # this very step, so that a resumed run loses nothing
                            self.checkpoint(index, s, step, opt, tokens, stage_end, clock.elapsed())
                        bar.close()
                        raise
        bar.close()

    def _forward_backward(self, stage, s: StageConfig, model, teacher, ids: torch.Tensor, w: torch.Tensor,
                          autocast) -> tuple[list, torch.Tensor]:
        """One step's loss and its gradients (added to each parameter's ``.grad``): the terms with detached sums
        (over every pass) and the counts over all processes ([n_terms]). With ``s.micro_batch_size`` smaller than
        this process's rows, the rows run in passes of that many and each pass's terms are divided by the whole
        batch's counts (``stage.counts``), so the gradient is the one pass's; DDP reduces on the last pass only."""
        env = self.env

        def backward(terms, counts) -> None:  # DDP averages gradients over processes: undo the 1/world
            loss = sum(weight * total / counts[j].clamp_min(1e-12) for j, (_, weight, total, _) in enumerate(terms))
            (loss * env.world).backward()

        rows = ids.shape[0]  # ids, w [rows, T]
        micro = min(s.micro_batch_size or rows, rows)
        if micro == rows:
            terms = stage.loss(s, model, teacher, ids, w, autocast)
            counts = all_reduce_sum(torch.stack([c.detach().float() for *_, c in terms]), env)  # [n_terms]
            backward(terms, counts)
            return [(n, wt, total.detach(), c) for n, wt, total, c in terms], counts
        if rows % micro:
            raise TrainConfigError(f"stages[{s.name}].micro_batch_size={s.micro_batch_size}: this process has {rows} "
                                   f"rows a step (batch_size={s.batch_size} over {env.world} processes), which "
                                   "passes of that size do not split evenly; choose a divisor of it")
        from contextlib import nullcontext

        parts = [(ids[i:i + micro], w[i:i + micro]) for i in range(0, rows, micro)]  # [micro, T] each
        local = torch.stack([torch.stack([c.float() for c in stage.counts(s, pi, pw)]) for pi, pw in parts]).sum(0)
        counts = all_reduce_sum(local, env)  # [n_terms]
        sums = torch.zeros_like(local)  # [n_terms]: each term's sum over the passes
        seen = torch.zeros_like(local)  # [n_terms]: the counts the loss itself gave, over the passes
        for k, (pi, pw) in enumerate(parts):
            sync = nullcontext() if k == len(parts) - 1 or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                terms = stage.loss(s, model, teacher, pi, pw, autocast)
                if len(terms) != len(local):
                    raise RuntimeError(f"stage {s.name!r}: its loss gave {len(terms)} terms, its counts() "
                                       f"{len(local)}; micro_batch_size needs the two to agree")
                backward(terms, counts)
            sums += torch.stack([total.detach().float() for _, _, total, _ in terms])
            seen += torch.stack([c.detach().float() for *_, c in terms])
        if not torch.allclose(seen, local, rtol=1e-6, atol=0.5):
            raise RuntimeError(f"stage {s.name!r}: its loss counted {seen.tolist()} over the passes, its counts() "
                               f"{local.tolist()}; the terms would be weighed wrongly: fix counts() or set "
                               "micro_batch_size = 0")
        return [(n, wt, sums[j], local[j]) for j, (n, wt, _, _) in enumerate(terms)], counts

    # ---- evaluation, checkpoints, final save -----------------------------------------------
    def run_eval(self, index: int, s: StageConfig, step: int) -> None:
        if self.evaluate is None or not (self.env.is_main or self.env.mode == "fsdp"):
            return
        model = self.student
        was = model.training
        model.eval()
        ctx = EvalContext(model, self.tokenizer, s.seq_len, self.config.eval_samples, self.env.device,
                          self.env.autocast(), self.config.seed, self._eval_cache,
                          base_len=self.config.stages[0].seq_len)
        t0 = time.time()
        with torch.random.fork_rng(devices=[self.env.device] if self.env.device.type == "cuda" else []):
            res = self.evaluate(ctx)
        model.train(was)
        if self.env.is_main:
            self._record({"stage": s.name, "stage_index": index, "step": step, **res,
                          "eval_seconds": round(time.time() - t0, 2)})

    def _record(self, rec: dict[str, Any]) -> None:
        self.history.append(rec)
        self.log.write(rec)

    def _model_state(self) -> dict[str, torch.Tensor]:
        if self.env.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            return get_model_state_dict(self.student, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._mw is not None:  # bf16 working weights: save the float32 masters
            return self._mw.state_dict()
        return self.student.state_dict()

    def _optimizer_state(self, opt) -> dict:
        if self.env.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.student, opt,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return opt.state_dict()

    def _load_optimizer(self, opt, state: dict) -> None:
        if self.env.mode == "fsdp":
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.student, opt, optim_state_dict=state,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            opt.load_state_dict(state)

    def checkpoint(self, index: int, s: StageConfig, step: int, opt, tokens: int, done: bool,
                   elapsed: float = 0.0) -> None:
        env = self.env
        model_state = self._model_state()
        opt_state = self._optimizer_state(opt)
        train_state = {"optimizer": opt_state, "scheduler": {"step": step, "lr": s.lr_at(max(0, step - 1))},
                       "data": {"stage_index": index, "step": step, "seed": self.config.seed}, "tokens": tokens,
                       "elapsed": elapsed}
        state = {"stage_index": index, "stage": s.name, "step": step, "stage_done": done,
                 "fingerprint": self.config.fingerprint(), "config": self.config.to_dict()}
        if self.mask is not None:
            state["mask"] = self.mask.to_dict()
        path = save_checkpoint(Path(self.config.out), f"s{index + 1}-{s.name}-{step:06d}", model_state,
                               train_state, state, env.rank, env.world, env.barrier if env.world > 1 else None,
                               keep=self.config.keep_checkpoints)
        if env.is_main:
            self.log.write({"event": "checkpoint", "path": path.name, "stage_index": index, "step": step})

    def save_final(self, out: Path) -> Path | None:
        from hybrid.train.build import save_final

        state = self._model_state() if self.env.mode == "fsdp" else None
        if not self.env.is_main:
            return None
        name = "hybrid" if self.config.is_hybrid else "model"
        self.student.config.train_config = self.config.to_dict()
        return save_final(self.student, self.tokenizer, out / name, state_dict=state)


def read_history(out: str | Path) -> list[dict[str, Any]]:
    from hybrid.train.logs import read_log

    return read_log(Path(out) / "log.jsonl")


