"""fla GDN kernels vs the PyTorch reference on the GPU: one table of relative errors (and JSON in $OUT).

Run (GPU machine, fla-core installed from the carried wheel):
    pip install --no-index --find-links .whl fla-core==0.6.0 pytest && python research/fla_parity_gpu.py
Rows: fla_chunk through our dispatch at head dims 64/128 and T 1024/4096, with the default backward ("dispatch":
fla's own backward, or on Hopper + Triton < 3.7.1 the torch-chunk recompute fallback) and, where fla's guard
applies, with the guard bypassed ("unguarded"); then the fla_recurrent decode kernel. Tolerance 1e-2 everywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pandas as pd
import torch

from hybrid.ops import parity
from hybrid.ops.gdn import fla_available, hopper_backward_guarded

TOL = 1e-2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--gate-normalizers", type=float, nargs="+", default=[1.0, 16.0],
                    help="g = logsigmoid(U(0,1)) / normalizer; 16 = slow decay, long memory")
    args = ap.parse_args()
    env = parity.environment()
    print("environment:", json.dumps(env))
    if not (torch.cuda.is_available() and fla_available()):
        sys.exit("needs CUDA and fla (pip install --no-index --find-links .whl fla-core==0.6.0 pytest)")
    guarded = hopper_backward_guarded()
    env["fla_guard_raises"] = str(parity.fla_guard_raises())
    print(f"fla's Hopper guard applies: {guarded}; fla's raw backward raises: {env['fla_guard_raises']}")

    rows = []
    modes = ["dispatch", "unguarded"] if guarded else ["dispatch"]
    for D in args.dims:
        for T in args.lengths:
            for gn in args.gate_normalizers:
                for mode in modes:
                    errs = parity.gdn_chunk_parity(B=args.batch, T=T, H=args.heads, D=D, gate_normalizer=gn,
                                                   allow_unverified_hopper_backward=mode == "unguarded")
                    rows.append(dict(kernel="fla_chunk", backward=mode, D=D, T=T, gate_norm=gn, **errs))
                    print(rows[-1], flush=True)
        for T in (1, 64):
            rows.append(dict(kernel="fla_recurrent", backward="-", D=D, T=T, gate_norm=1.0,
                             **parity.gdn_recurrent_parity(B=args.batch, T=T, H=args.heads, D=D)))
    df = pd.DataFrame(rows)
    err_cols = ["o", "ht"] + [f"d{n}" for n in parity.GRAD_NAMES]
    err_cols = [c for c in err_cols if c in df.columns]
    df["max_err"] = df[err_cols].max(axis=1)
    df["ok"] = df["max_err"] <= TOL
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.2e}".format):
        print(df.to_string(index=False))
    verified: list[tuple[int, int]] = []
    if guarded:
        unguarded = df[df.backward == "unguarded"]
        verified = sorted({(int(d), int(d)) for d, grp in unguarded.groupby("D") if grp.ok.all()})
        print(f"\nRECOMMENDATION: hybrid/ops/gdn.py HOPPER_BWD_VERIFIED_DIMS = frozenset({set(verified) or '()'})"
              "  (head dims whose unguarded fla backward matched at every T and gate)")
    print(f"\nall dispatch rows within {TOL}: {bool(df[df.backward != 'unguarded'].ok.all())}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        payload = dict(environment=env, tolerance=TOL, verified_dims=verified, rows=df.to_dict(orient="records"))
        (Path(out) / "fla_parity.json").write_text(json.dumps(payload, indent=1))
        print(f"wrote {out}/fla_parity.json")


if __name__ == "__main__":
    main()
