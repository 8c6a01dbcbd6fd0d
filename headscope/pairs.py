"""The one way from a task to tokenized pairs, for every function that takes ``(model, task, ...)``.

    pairs = task_pairs(model, "niah", n_samples=8, seed=0, context_length=1024)   # list[TokenizedPair]
    pairs = task_pairs(None, "niah", tokenizer=tok, n_samples=8)                   # no model: tokenizer given
    task_name("niah", pairs)                                                        # "niah"

``task`` is a registered name (built with ``get_task(name, **task_config, **task_kwargs)``, on top of the
task defaults a registry model carries: ``headscope.zoo.task_defaults``), a Task
object, or a list of TokenizedPair (returned as they are: n_samples / seed / task options do not apply).
The tokenizer is ``headscope.tokenizers.find_tokenizer(model, tokenizer)``: an explicit one wins, else
the model's own is found. It is checked against the model's vocabulary when a model is given.
"""
from __future__ import annotations

from typing import Any

__all__ = ["task_pairs", "task_name", "check_n_samples"]

_PAIR_FIELDS = ("clean_ids", "corrupt_ids", "answer_pos", "clean_answer_ids")


def check_n_samples(n_samples: Any) -> None:
    if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")


def _vocab_size(model: Any) -> int | None:
    from headscope.tokenizers import unwrap

    inner = unwrap(model)
    get = getattr(inner, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    weight = getattr(emb, "weight", None)
    return None if weight is None else int(weight.shape[0])


def _check_tokenizer(tokenizer: Any, vocab_size: int | None) -> None:
    n = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    if vocab_size is not None and n is not None and n > vocab_size:
        from headscope.patching.inputs import PatchInputError

        raise PatchInputError(f"the tokenizer has {n} tokens but the model's embedding has {vocab_size} rows: the "
                         "tokenizer does not match the model; pass the model's own tokenizer (tokenizer=...)")


def task_pairs(model: Any, task: Any, *, tokenizer: Any = None, n_samples: int = 8, seed: int = 0,
               task_config: dict | None = None, **task_kwargs) -> list:
    """Tokenized pairs of ``task`` for ``model`` (see the module docstring). ``model`` may be None when a
    tokenizer is given or ``task`` is already a list of pairs."""
    options = {**(task_config or {}), **task_kwargs}
    if isinstance(task, (list, tuple)):
        if not task:
            raise ValueError("no pairs given: the list of TokenizedPairs is empty; pass a task name or some pairs")
        missing = [f for f in _PAIR_FIELDS if not hasattr(task[0], f)]
        if missing:
            raise TypeError(f"a list task must hold TokenizedPairs (task.tokenized(tokenizer, n, seed)); its first "
                            f"item, a {type(task[0]).__name__}, lacks {missing}")
        if options:
            raise ValueError(f"task options {sorted(options)} only apply to a task given by name, not to a list of "
                             "pairs")
        return list(task)
    check_n_samples(n_samples)
    if isinstance(task, str):
        from headscope.tasks import get_task
        from headscope.tokenizers import unwrap
        from headscope.zoo import task_defaults

        # a registry model's task defaults (headscope.zoo) fill the fields the caller did not set
        defaults = task_defaults(unwrap(model), task) if model is not None else {}
        task = get_task(task, **{**defaults, **options})
    elif options:
        raise ValueError(f"task options {sorted(options)} only apply to a task given by name; configure the "
                         f"{type(task).__name__} when you build it")
    if not hasattr(task, "tokenized"):
        raise TypeError(f"task must be a name ({', '.join(_task_names())}), a Task or a list of TokenizedPair, got "
                        f"{type(task).__name__}")
    if model is None and tokenizer is None:
        raise ValueError(f"task_pairs: give a model (its tokenizer is found) or tokenizer=... to build pairs of "
                         f"{task_name(task)!r}")
    from headscope.tokenizers import find_tokenizer

    tokenizer = find_tokenizer(model, tokenizer)
    if model is not None:
        _check_tokenizer(tokenizer, _vocab_size(model))
    pairs = task.tokenized(tokenizer, n_samples, seed)
    if not pairs:
        raise ValueError(f"task {task_name(task)!r} gave no pairs; pass n_samples >= 1")
    return pairs


def task_name(task: Any, pairs: Any = None) -> str:
    """A task's name: the registered name, the Task's ``name``, or the task recorded in a list of pairs."""
    if isinstance(task, str):
        return task
    if isinstance(task, (list, tuple)):
        first = task[0] if task else None
        return getattr(getattr(first, "pair", None), "task", "custom")
    return getattr(task, "name", type(task).__name__)


def _task_names() -> list[str]:
    from headscope.tasks import list_tasks

    return list_tasks()
