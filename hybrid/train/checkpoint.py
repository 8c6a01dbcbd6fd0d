"""Checkpoints: weights as safetensors; optimizer, schedule position, data position and RNG states beside
them; written atomically (a temporary folder renamed into place, then the ``LATEST`` pointer rewritten through
``headscope.io``), so a killed or failed write never leaves a checkpoint that ``load`` would accept.

    OUT/run.json                         the run: identity (teacher, mask, model), config fingerprint, config
    OUT/checkpoints/LATEST               the name of the newest complete checkpoint
    OUT/checkpoints/s2-distill-000040/   model.safetensors, train_state.pt, rng-<rank>.pt, state.json (last)

The schedule is a pure function of the step (``StageConfig.lr_at``) and a batch a pure function of
(seed, stage, step) (``hybrid.train.data``): the saved step is both the scheduler's and the data's position.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

__all__ = ["CheckpointError", "Checkpoint", "RunRecord", "save_checkpoint", "latest_checkpoint",
           "load_checkpoint", "check_run_folder", "check_output_folder", "config_changes", "rng_state", "set_rng_state"]

SCHEMA = "hybrid.train.checkpoint"
RUN_SCHEMA = "hybrid.train.run"
# identity key: the teacher's legacy_config_fingerprint (the one run folders started before RoPE settings were
# hashed recorded); compared in place of the current one, never written to run.json
LEGACY_TEACHER = "teacher_legacy"


class CheckpointError(RuntimeError):
    """A checkpoint or output folder that cannot be used for this run (the message says why and what to do)."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    state: dict[str, Any]  # state.json: stage index/name, step, done, fingerprints

    @property
    def stage_index(self) -> int:
        return int(self.state["stage_index"])

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def done(self) -> bool:
        return bool(self.state["stage_done"])


@dataclass(frozen=True)
class RunRecord:
    identity: dict[str, Any]  # what makes it the same run: teacher/model fingerprint, mask, hybrid options
    fingerprint: str  # TrainConfig.fingerprint()
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        identity = {k: v for k, v in self.identity.items() if k != LEGACY_TEACHER} \
            if isinstance(self.identity, dict) else self.identity
        return {"schema": RUN_SCHEMA, "identity": identity, "fingerprint": self.fingerprint, "config": self.config}


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


def _ckpt_dir(out: Path) -> Path:
    return Path(out) / "checkpoints"


def _dedup(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Drop tensors sharing storage with an earlier one (tied embeddings): (tensors, {dropped: kept})."""
    seen: dict[tuple, str] = {}
    out, tied = {}, {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape), v.dtype) if v.numel() else None
        if key is not None and key in seen:
            tied[k] = seen[key]
            continue
        if key is not None:
            seen[key] = k
        out[k] = v.detach().cpu().contiguous()
    return out, tied


def save_checkpoint(out: Path, name: str, model_state: dict[str, torch.Tensor] | None, train_state: dict | None,
                    state: dict[str, Any], rank: int = 0, world: int = 1, barrier=None, keep: int = 2,
                    _fail_after_weights: bool = False) -> Path:
    """Write checkpoint ``name`` atomically (every rank calls it; rank 0 writes weights and optimizer state,
    every rank its RNG state). Returns the final folder."""
    from headscope.io import write_bytes, write_text

    root = _ckpt_dir(out)
    tmp, final = root / f".tmp-{name}", root / name
    if rank == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    if barrier:
        barrier()
    import io

    buf = io.BytesIO()
    torch.save(rng_state(), buf)
    write_bytes(tmp / f"rng-{rank}.pt", buf.getvalue())
    if rank == 0:
        tensors, tied = _dedup(model_state)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"schema": SCHEMA})
        if _fail_after_weights:  # tests: a write killed half-way
            raise OSError("simulated failure while writing a checkpoint")
        buf = io.BytesIO()
        torch.save(train_state, buf)
        write_bytes(tmp / "train_state.pt", buf.getvalue())
    if barrier:
        barrier()
    if rank == 0:
        write_text(tmp / "state.json", json.dumps({"schema": SCHEMA, **state, "tied": tied, "world": world},
                                                  indent=1))  # last: marks the folder complete
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text(root / "LATEST", name)
        complete = sorted((p for p in root.iterdir() if p.is_dir() and (p / "state.json").exists()),
                          key=lambda p: _order(p))
        for old in complete[:-keep]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    if barrier:
        barrier()
    return final


def _order(path: Path) -> tuple[int, int]:
    st = json.loads((path / "state.json").read_text())
    return int(st["stage_index"]), int(st["step"])


def _read(path: Path) -> Checkpoint:
    f = path / "state.json"
    if not f.exists():
        raise CheckpointError(f"checkpoint {path} is incomplete (no state.json: its write did not finish); it is "
                              "never loaded: resume from an earlier one, or start again without --resume")
    try:
        state = json.loads(f.read_text())
    except json.JSONDecodeError:
        raise CheckpointError(f"checkpoint {path}: state.json is not valid JSON (corrupt); delete the folder") from None
    if state.get("schema") != SCHEMA:
        raise CheckpointError(f"{path} is not a hybrid.train checkpoint (schema {state.get('schema')!r})")
    for part in ("model.safetensors", "train_state.pt"):
        if not (path / part).exists():
            raise CheckpointError(f"checkpoint {path} has no {part}; it is incomplete and is not loaded")
    return Checkpoint(path, state)


def latest_checkpoint(out: Path) -> Checkpoint | None:
    """The newest complete checkpoint of ``out`` (``LATEST``, else the newest folder with a state.json)."""
    root = _ckpt_dir(out)
    if not root.exists():
        return None
    pointer = root / "LATEST"
    if pointer.exists():
        return _read(root / pointer.read_text().strip())
    complete = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / "state.json").exists()]
    return _read(max(complete, key=_order)) if complete else None


def load_checkpoint(ckpt: Checkpoint, rank: int = 0) -> tuple[dict[str, torch.Tensor], dict, dict]:
    """(model tensors incl. tied names, train_state, this rank's RNG state)."""
    tensors = load_file(str(ckpt.path / "model.safetensors"))
    for dropped, kept in ckpt.state.get("tied", {}).items():
        tensors[dropped] = tensors[kept]
    train_state = torch.load(ckpt.path / "train_state.pt", map_location="cpu", weights_only=False)
    rng_file = ckpt.path / f"rng-{rank}.pt"
    if not rng_file.exists():
        raise CheckpointError(f"checkpoint {ckpt.path} has no RNG state for process {rank} (it was written by "
                              f"{ckpt.state.get('world')} processes); resume with the same number of processes")
    rng = torch.load(rng_file, map_location="cpu", weights_only=False)
    return tensors, train_state, rng


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """``field: old -> new`` for every leaf that differs; lists of equal length compared item by item
    (``stages[1].lr``), a stage named by its ``name`` when it has one."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (va, vb) in enumerate(zip(a, b)):
            name = va.get("name") if isinstance(va, dict) and isinstance(vb, dict) and va.get("name") == vb.get("name") \
                else None
            out += _diff(va, vb, f"{prefix}[{i + 1}{':' + name if name else ''}]")
        return out
    return [] if a == b else [f"{prefix or 'value'}: {a!r} -> {b!r}"]


def config_changes(old: dict, new: dict) -> list[str]:
    """The changed fields between two ``TrainConfig.to_dict()``s that the fingerprint counts (the bookkeeping
    fields it ignores, e.g. out/device/threads, left out); every changed field when only those differ."""
    import inspect

    from hybrid.train.config import TrainConfig

    params = inspect.signature(TrainConfig.fingerprint).parameters
    ignore, ignore_stage = set(params["ignore"].default), set(params["ignore_stage"].default)

    def counted(d: dict) -> dict:
        d = {k: v for k, v in (d or {}).items() if k not in ignore}
        if isinstance(d.get("stages"), list):
            d["stages"] = [{k: v for k, v in s.items() if k not in ignore_stage} if isinstance(s, dict) else s
                           for s in d["stages"]]
        return d

    return _diff(counted(old), counted(new)) or _diff(old or {}, new or {})


def _upgrade_identity(identity: Any) -> Any:
    """A run.json identity with its hybrid options under their current names (``fusion`` -> ``merge``)."""
    if not isinstance(identity, dict) or not isinstance(identity.get("hybrid"), dict):
        return identity
    from hybrid.config import upgrade_options

    return {**identity, "hybrid": upgrade_options(identity["hybrid"])}


def _comparable(old: Any, new: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """(old, new) identities as compared: the old one's hybrid options under their current names, and the
    teacher's legacy fingerprint (``LEGACY_TEACHER``), where either records it as the teacher's or its mask's,
    read as the teacher's current one: a folder started before RoPE settings were hashed is the same run."""
    old = _upgrade_identity(old)
    new = dict(new)
    legacy = new.pop(LEGACY_TEACHER, None)
    if not isinstance(old, dict):
        return old, new
    old = {k: v for k, v in old.items() if k != LEGACY_TEACHER}
    current = new.get("teacher")
    if legacy is None or current is None or legacy == current:
        return old, new

    def read(identity: dict[str, Any]) -> dict[str, Any]:
        if identity.get("teacher") == legacy:
            identity = {**identity, "teacher": current}
        mask = identity.get("mask")
        if isinstance(mask, dict) and mask.get("fingerprint") == legacy:
            identity = {**identity, "mask": {**mask, "fingerprint": current}}
        return identity

    return read(old), read(new)


def check_run_folder(out: Path, record: RunRecord, resume: bool, allow_config_change: bool) -> Checkpoint | None:
    """Refuse an output folder of a different run, a fresh start over existing checkpoints and (unless
    ``allow_config_change``) a resume with a changed config. Returns the checkpoint to resume from (or None).
    A folder that records the teacher's legacy fingerprint (started before RoPE settings were hashed) is the
    same run."""
    out = Path(out)
    run_file = out / "run.json"
    old = None
    if run_file.exists():
        try:
            old = json.loads(run_file.read_text())
        except json.JSONDecodeError:
            raise CheckpointError(f"{run_file} is not valid JSON; delete it or choose another output folder") from None
        if old.get("schema") != RUN_SCHEMA:
            raise CheckpointError(f"{out} holds a run.json that is not a hybrid.train run; choose another folder")
        was, now = _comparable(old.get("identity"), record.identity)
        if was != now:
            changed = _diff(was or {}, now)
            raise CheckpointError(f"{out} belongs to a different run ({'; '.join(changed)}): its checkpoints do not "
                                  "fit this teacher/mask/model; choose another output folder")
    ckpt = latest_checkpoint(out)
    if not resume:
        if ckpt is not None:
            raise CheckpointError(f"{out} already holds checkpoints of this run (latest {ckpt.path.name}); pass "
                                  "--resume (resume=True) to continue it, or choose another output folder")
        return None
    if ckpt is None:
        raise CheckpointError(f"--resume: {out} has no complete checkpoint to resume from; drop --resume")
    if old is not None and old.get("fingerprint") != record.fingerprint and not allow_config_change:
        changed = config_changes(old.get("config", {}), record.config) or [
            f"fingerprint {old.get('fingerprint')} -> {record.fingerprint}"]
        raise CheckpointError(f"--resume with a changed config ({'; '.join(changed)}): refused; restore the old "
                              "config or pass --allow-config-change (allow_config_change=True) to continue anyway")
    return ckpt


def check_output_folder(out: Path) -> None:
    """Refuse an output path that is a file, or a folder (or the nearest existing parent of a new one) that this
    process cannot write, before any model is loaded."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"output folder {out} is an existing file, not a folder: choose another output "
                              "folder (--out DIR, or out = ... in the config) or remove the file")
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise CheckpointError(f"output folder {out}: {probe} is a file, not a folder; choose another output "
                              "folder (--out DIR, or out = ... in the config)")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        what = "output folder" if probe == out else f"the output folder's parent {probe} (to create {out})"
        raise CheckpointError(f"{what} is not writable: choose a writable output folder (--out DIR, or out = ... "
                              "in the config) or fix its permissions")


def write_run_record(out: Path, record: RunRecord) -> None:
    from headscope.io import write_text

    write_text(Path(out) / "run.json", json.dumps(record.to_dict(), indent=1, default=str))
