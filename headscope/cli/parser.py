"""The ``headscope`` argument parser: one subcommand each, its options, and the function that runs it."""
from __future__ import annotations

import argparse

from headscope.cli.figures import cmd_knockout, cmd_plot
from headscope.cli.scoring import DEFAULT_SENDER_ROUNDS, cmd_run, cmd_score
from headscope.cli.selecting import cmd_select

def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default",
                   help="'default' (the shipped reference model, the default) or a local Hugging Face folder")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def _add_overwrite(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files that are not headscope outputs of the same kind")


def _add_tasks(p: argparse.ArgumentParser, multiple: bool = True, default_help: str = "niah") -> None:
    if multiple:
        p.add_argument("--task", action="append", default=None,
                       help="task to score (repeatable): niah, niah_multikey, arithmetic, binding, comparison, "
                            f"two_hop, reasoning (default: {default_help})")
    p.add_argument("--n-samples", type=int, default=8, help="prompt pairs per task (default 8)")
    p.add_argument("--context-length", type=int, default=None,
                   help="prompt length in tokens, for tasks that have one (NIAH; default: the task's, 1024)")
    p.add_argument("--task-arg", action="append", metavar="KEY=VALUE", help="extra task option, e.g. depth=0.5")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metric", default="logit_diff", choices=["logit_diff", "logprob"])
    p.add_argument("--batch-size", type=int, default=None)


def _add_score_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto", help="scoring backend (default auto)")
    p.add_argument("--on-clean-failure", default="warn", choices=["warn", "drop", "error"],
                   help="when the model gets under half of the clean prompts right: warn (default), score only "
                        "the pairs it solves (drop), or stop (error)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--shard", choices=["heads", "samples", "auto"], default=None,
                   help="under torchrun (`torchrun --nproc_per_node N -m headscope ...`): split the scoring over "
                        "the processes (one GPU each, or gloo on CPUs) by heads or by samples; rank 0 writes")


def _add_selection(p: argparse.ArgumentParser) -> None:
    from headscope.fusion import COMBINE_RULES, DEFAULT_THRESHOLD, STABILITY_METHODS
    from headscope.selection import DEFAULT_STRATEGY, STRATEGIES

    g = p.add_mutually_exclusive_group()
    g.add_argument("--k", type=int, help="number of full-attention heads")
    g.add_argument("--fraction", type=float, help="fraction of heads kept as full attention, in (0, 1]")
    g.add_argument("--ratio", help="LA:FA ratio, e.g. 7:1 (the default when no budget is given)")
    p.add_argument("--strategy", default=DEFAULT_STRATEGY, choices=STRATEGIES,
                   help="global top-K; global top-K with >= 1 FA head per layer (default); top-K/L per layer")
    p.add_argument("--stability", default="frac", choices=STABILITY_METHODS,
                   help="per-task stability weighting (default frac: mean x fraction of samples > threshold)")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"'important on a sample' threshold for --stability frac (default {DEFAULT_THRESHOLD})")
    p.add_argument("--weights", type=float, nargs="+", help="task weights, in task order (default equal)")
    p.add_argument("--combine", default="max", choices=COMBINE_RULES,
                   help="how a task's receiver and sender scores combine (default max)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headscope", description=(
        "Find the attention heads a model's retrieval and reasoning causally depend on, and pick the ones to "
        "keep as full attention in a head-level hybrid."))
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("run", help="score -> fuse -> select -> mask.json in one go",
                       description="The whole method: receiver scores and sender scores (iterated path patching) "
                                   "on NIAH and the reasoning tasks, stability-weighted fusion, selection; writes "
                                   "the mask. --quick: receiver scores on NIAH only.")
    _add_model(p)
    _add_tasks(p, default_help="niah and reasoning; with --quick: niah")
    _add_score_opts(p)
    p.add_argument("--quick", action="store_true",
                   help="receiver scores only, on NIAH only (unless --task is given): about 4x faster")
    p.add_argument("--sender-rounds", type=int, default=DEFAULT_SENDER_ROUNDS,
                   help=f"iterated path patching rounds per task (default {DEFAULT_SENDER_ROUNDS}; 0: receiver "
                        "scores only)")
    p.add_argument("--sender-k", type=int, default=None,
                   help="receivers per path-patching round (default 2%% of all heads, at least 1)")
    _add_selection(p)
    p.add_argument("--out", default="mask.json", help="head-mask JSON to write (default mask.json)")
    p.add_argument("--save-scores", metavar="DIR", help="also write each task's receiver (and sender) scores and "
                                                        "the fused scores into this folder")
    p.add_argument("--plot", metavar="FILE", help="also write a heatmap of the fused scores (.html or .png)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("score", help="causal receiver scores of every head on one or more tasks",
                       description="Score every head by activation patching; one JSON file per task.")
    _add_model(p)
    _add_tasks(p)
    _add_score_opts(p)
    p.add_argument("--out", required=True,
                   help="scores JSON; with several tasks, OUT's stem gets the task name (scores.niah.json, ...)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("select", help="fuse score files and select FA heads into a mask",
                       description="Fuse score files (one per task; a task's receiver and sender files are "
                                   "combined) and select the full-attention heads.")
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON files (from `headscope score`)")
    _add_selection(p)
    p.add_argument("--seed", dest="tie_seed", type=int, default=None, help="random tie-breaking among equal scores")
    p.add_argument("--model", default=None, help="'default' or a local folder: record its shape and fingerprint "
                                                 "(default: the model the scores record, when they record one)")
    p.add_argument("--out", required=True, help="head-mask JSON to write")
    _add_overwrite(p)
    p.set_defaults(func=cmd_select)

    p = sub.add_parser("knockout", help="accuracy as the top-k heads (vs random heads) are knocked out",
                       description="Knock out the top-k heads by score and as many random heads; write a CSV.")
    _add_model(p)
    p.add_argument("--scores", nargs="+", required=True, help="scores JSON file(s); several are fused")
    p.add_argument("--task", default=None, help="task to evaluate on (default: the scores' task)")
    _add_tasks(p, multiple=False)
    p.add_argument("--kind", default="patch", choices=["patch", "mean", "zero"],
                   help="knockout: patch (default, the paper's: a head takes its activation from the corrupted "
                        "prompt), mean (its mean activation over the prompts) or zero")
    p.add_argument("--n-random", type=int, default=5, help="random head sets per k (default 5)")
    p.add_argument("--max-fraction", type=float, default=0.1, help="largest fraction of heads knocked out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--out", required=True, help="CSV to write")
    p.add_argument("--plot", metavar="FILE", help="also write the knockout figure (.html or .png)")
    _add_overwrite(p)
    p.set_defaults(func=cmd_knockout)

    p = sub.add_parser("plot", help="figures: heatmap, knockout, stability, similarity",
                       description="heatmap: a scores or mask JSON; knockout: a knockout CSV; stability: a "
                                   "scores JSON (computed) or CSV; similarity: a layer-similarity CSV.")
    p.add_argument("figure", choices=["heatmap", "knockout", "stability", "similarity"])
    p.add_argument("--in", dest="inp", required=True, help="input file")
    p.add_argument("--out", required=True, help="figure to write: .html (or .png with kaleido)")
    p.add_argument("--mask", help="heatmap: a mask JSON whose FA heads are marked")
    p.add_argument("--title", default=None)
    p.add_argument("--band", default="minmax", choices=["minmax", "std"], help="knockout: random-curve band")
    p.add_argument("--k", type=int, default=None, help="stability: top-K for the overlap (default 5%% of heads)")
    p.add_argument("--seed", type=int, default=0)
    _add_overwrite(p)
    p.set_defaults(func=cmd_plot)

    from headscope.evaluate.cli import add_parser as add_eval_parser

    add_eval_parser(sub)
    return parser

