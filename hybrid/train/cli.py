"""``hybrid-train --config FILE [--stage 1|2|3|all] [--resume] [--allow-config-change] [--out DIR]``.

Runs as one process, or under ``torchrun --nproc_per_node N -m hybrid.train.cli ...`` (DDP / FSDP)."""
from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hybrid-train", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="a TOML (or YAML / JSON) training config")
    ap.add_argument("--stage", default="all", help="'all' (default) or one stage number, 1-based in file order")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output folder")
    ap.add_argument("--allow-config-change", action="store_true",
                    help="resume even though the config differs from the one the checkpoints were written with")
    ap.add_argument("--out", default=None, help="override the config's output folder")
    ap.add_argument("--device", default=None, help="override the config's device (auto, cpu, cuda)")
    a = ap.parse_args(argv)

    from hybrid.train import TrainConfig, TrainConfigError, run
    from hybrid.train.checkpoint import CheckpointError
    from headscope.patching.sharded import end_process_group

    overrides = {k: v for k, v in (("out", a.out), ("device", a.device)) if v is not None}
    finished = False
    try:
        config = TrainConfig.from_file(a.config, **overrides)
        result = run(config, stage=a.stage, resume=a.resume, allow_config_change=a.allow_config_change)
        finished = True
    except (TrainConfigError, CheckpointError, FileNotFoundError, FileExistsError, NotADirectoryError,
            ValueError) as err:
        print(f"hybrid-train: error: {err}", file=sys.stderr)
        return 2
    finally:
        end_process_group(finished)  # under torchrun: the process group setup() started ends with the command
    last = {k: v for r in result.history for k, v in r.items()}
    print(json.dumps({"out": str(result.out), "model": str(result.model_path) if result.model_path else None,
                      "last": last}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
