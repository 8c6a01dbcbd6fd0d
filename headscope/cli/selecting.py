"""``headscope select``: fuse score files and select the full-attention heads into a mask, for --model or for the
model the scores record."""
from __future__ import annotations

import argparse
from typing import Any

from headscope.cli.common import (MASK_KIND, UsageError, check_out, fuse_scores, load_scores, log, model_config,
                                  select_heads, shape_text)

_FINGERPRINT_KEYS = ("config_fingerprint", "fingerprint", "model_fingerprint")


def _recorded_model(scores: list) -> dict[str, Any] | None:
    """The model the scores files record (``settings``: model name or path, fingerprint, model type; the
    scores' own shape and KV heads), or None when none records one. Files that record different models
    are refused."""
    found: dict[str, dict[str, Any]] = {}
    for s in scores:
        st = s.settings or {}
        model = st.get("model")
        nested = model if isinstance(model, dict) else {}
        name = nested.get("name") or nested.get("name_or_path") if nested else model
        fp = next((v for src in (st, nested) for k in _FINGERPRINT_KEYS if (v := src.get(k))), None)
        if not name and not fp:
            continue
        rec = {"name": str(name) if name else None, "fingerprint": str(fp) if fp else None,
               "model_type": st.get("model_type") or nested.get("model_type"),
               "n_layers": s.n_layers, "n_heads": s.n_heads, "n_kv_heads": s.n_kv_heads,
               "recorded_shape": (st.get("n_layers"), st.get("n_heads"))}
        found[s.task + "/" + s.kind] = rec
    if not found:
        return None
    fps = {r["fingerprint"] for r in found.values() if r["fingerprint"]}
    if len(fps) > 1:
        raise UsageError(f"the scores files come from different models (config fingerprints {sorted(fps)}); "
                         "pass scores of one model, and --model for it")
    rec = next(iter(found.values()))
    if fps:
        rec = next(r for r in found.values() if r["fingerprint"])
    return rec


def _recorded_config(rec: dict[str, Any]):
    """The local config of the recorded model when it is still on disk and still matches the recorded
    fingerprint, else None."""
    from headscope.mask import fingerprint_matches

    if not rec["name"]:
        return None
    try:
        cfg = model_config(rec["name"])
    except Exception:  # not a local folder (a hub name, a moved folder): the recorded fields are used instead
        return None
    if rec["fingerprint"] and not fingerprint_matches(cfg, rec["fingerprint"]):
        return None
    return cfg


def _check_scores_fit_model(fused, cfg, spec: str, rec: dict[str, Any] | None, recorded: bool = False) -> None:
    from headscope.mask import model_shape

    shape = model_shape(cfg)
    ml, mh = shape["num_hidden_layers"], shape["num_attention_heads"]
    if (fused.n_layers, fused.n_heads) == (ml, mh):
        return
    if recorded:
        raise UsageError(f"the scores are {shape_text(fused.n_layers, fused.n_heads)} but the model they record, "
                         f"{spec}, has {shape_text(ml, mh)}: rescore that model (headscope score --model {spec}), "
                         "or pass --model the scores came from")
    came = f" ({rec['name']}, recorded in the scores)" if rec and rec.get("name") else ""
    raise UsageError(f"the scores are {shape_text(fused.n_layers, fused.n_heads)} but --model {spec} has "
                     f"{shape_text(ml, mh)}: pass scores of this model (headscope score --model {spec}), or "
                     f"--model the scores came from{came}")


def _select_for_recorded_model(fused, args: argparse.Namespace, rec: dict[str, Any] | None):
    """select without --model: the mask carries the model the scores record (its shape, KV heads and
    fingerprint, from its local config when that still matches, else from the recorded fields)."""
    import dataclasses

    if rec is None:
        log(f"select: no --model and the scores record no model: the mask is for "
            f"{shape_text(fused.n_layers, fused.n_heads)} (the scores' shape) without a config fingerprint; "
            "pass --model to record the model")
        return select_heads(fused, args, None)
    cfg = _recorded_config(rec)
    if cfg is not None:
        _check_scores_fit_model(fused, cfg, rec["name"], rec, recorded=True)
        mask = select_heads(fused, args, cfg)
    else:
        rl, rh = rec["recorded_shape"]
        if rl is not None and rh is not None and (int(rl), int(rh)) != (fused.n_layers, fused.n_heads):
            raise UsageError(f"the scores are {shape_text(fused.n_layers, fused.n_heads)} but record a model "
                             f"of {shape_text(int(rl), int(rh))} ({rec['name'] or 'unnamed'}): the file was edited "
                             "or mixed up; rescore, or pass --model the scores came from")
        mask = select_heads(fused, args, None)
        if rec["fingerprint"] or rec["model_type"]:
            mask = dataclasses.replace(mask, fingerprint=rec["fingerprint"] or mask.fingerprint,
                                       model_type=rec["model_type"] or mask.model_type)
    mask.settings["model"] = rec["name"]
    mask.settings["model_from"] = "the scores' settings (no --model)"
    kv = f", {mask.n_kv_heads} KV heads" if mask.n_kv_heads is not None else ""
    fp = f", config fingerprint {mask.fingerprint}" if mask.fingerprint else ", no config fingerprint"
    src = "its local config" if cfg is not None else "the fields the scores record"
    log(f"select: no --model: the mask is for the model the scores record, {rec['name'] or 'unnamed'} "
        f"({shape_text(mask.n_layers, mask.n_heads)}{kv}{fp}; from {src})")
    return mask


def cmd_select(args: argparse.Namespace) -> None:
    check_out(args.out, MASK_KIND, args)
    scores = load_scores(args.scores)
    rec = _recorded_model(scores)
    fused = fuse_scores(scores, args.combine, args.stability, args.weights, args.threshold)
    if args.model is not None:
        cfg = model_config(args.model)
        _check_scores_fit_model(fused, cfg, args.model, rec)
        mask = select_heads(fused, args, cfg)
    else:
        mask = _select_for_recorded_model(fused, args, rec)
    mask.to_json(args.out)
    print(mask.summary())
    log(f"wrote {args.out}")

