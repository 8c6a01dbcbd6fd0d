"""Counterfactual prompt-pair tasks (NIAH retrieval, reasoning) for head-importance scoring.

    task = get_task("niah", context_length=1024, depth=0.5)
    pairs = task.generate(tokenizer, n=8, seed=0)   # list[PromptPair], deterministic per seed
    tps = task.tokenized(tokenizer, n=8, seed=0)    # list[TokenizedPair]: teacher-forced with the clean answer
"""
from headscope.tasks.base import (TASKS, PairError, PromptPair, Task, TokenizedPair, UnknownTaskError, from_pairs,
                                  get_task, list_tasks, register_task, tokenize_pair)
from headscope.tasks.haystack import load_haystack
from headscope.tasks.niah import NiahMultikeyTask, NiahTask
from headscope.tasks.reasoning import FAMILIES, ReasoningTask

register_task("niah", NiahTask)
register_task("niah_multikey", NiahMultikeyTask)
for _name, _cls in FAMILIES.items():
    register_task(_name, _cls)
register_task("reasoning", ReasoningTask)

__all__ = ["PromptPair", "TokenizedPair", "PairError", "UnknownTaskError", "Task", "get_task", "register_task",
           "list_tasks", "from_pairs", "tokenize_pair", "load_haystack", "TASKS"]
