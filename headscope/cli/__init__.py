"""The ``headscope`` command line: score heads, fuse and select them into a mask, knock them out, plot.

    headscope run --model default --out mask.json              # the whole method (NIAH + reasoning, senders)
    headscope run --model default --quick --out mask.json      # receiver scores on NIAH only
    headscope score --model default --task niah --n-samples 8 --context-length 1024 --out niah.json
    headscope select --scores niah.json reasoning.json --ratio 7:1 --model default --out mask.json
    headscope knockout --model default --scores niah.json --out curve.csv --plot curve.html
    headscope plot heatmap --in niah.json --out niah.html
    headscope eval --model default --suite smoke --out results/smoke

User errors (bad arguments, missing files, unknown tasks, a model the data do not fit) print one
line ``headscope: error: ...`` and exit with status 2; ``--debug`` shows the traceback instead.
Every output is checked before any scoring starts (a folder, a wrong suffix, an existing file that is not
an artifact of the same kind: pass ``--overwrite``) and written atomically (headscope.io).

Modules: ``scoring`` (score, run), ``selecting`` (select), ``figures`` (knockout, plot), ``estimate`` (the time
estimate), ``common`` (what they share), ``parser``; ``eval`` is ``headscope.evaluate.cli``.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Sequence

from headscope.cli import common
from headscope.cli.parser import build_parser

__all__ = ["main", "build_parser"]


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors that mean "fix your input", shown as one line with exit status 2."""
    from headscope.arch import UnsupportedModelError
    from headscope.plots import PngExportError

    errors: list[type[BaseException]] = [ValueError, LookupError, OSError, ImportError, UnsupportedModelError,
                                         PngExportError]
    try:
        from headscope.patching.engine import CleanFailureError, DegeneratePairError

        errors += [CleanFailureError, DegeneratePairError]
    except ImportError:
        pass
    return tuple(errors)


@contextlib.contextmanager
def _library_bars(show: bool):
    """--quiet: transformers' own progress bars (loading and writing weights) off for the command, as it was after."""
    if show:
        yield
        return
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "task", None) is None and args.command == "score":
        args.task = ["niah"]
    for name in ("n_samples", "batch_size", "context_length", "sender_k"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if getattr(args, "sender_rounds", 0) < 0:
        return _fail(f"--sender-rounds must be >= 0, got {args.sender_rounds}")
    try:
        with _library_bars(not getattr(args, "quiet", False)):
            args.func(args)
        if getattr(args, "shard_mode", None):
            common.stop_shard()
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)
    except Exception as err:
        if args.debug:
            raise
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        if isinstance(err, _user_errors()):
            return _fail(msg)
        return _fail(f"{type(err).__name__}: {msg} (an internal error: rerun with --debug for the traceback and "
                     "please report it)", code=1)
    return 0


def _fail(msg: str, code: int = 2) -> int:
    print(f"headscope: error: {msg}", file=sys.stderr)
    return code
