"""Random clean/corrupt token pairs for the patching tests (import by name: `from patching_pairs import ...`)."""
from types import SimpleNamespace

import torch


def make_pair(T: int, first_diff: int, n_answer: int, seed: int, vocab: int = 128, span: int = 2):
    """Random clean ids; corrupt differs on [first_diff, first_diff + span); answers are the last n_answer rows."""
    g = torch.Generator().manual_seed(seed)
    clean = torch.randint(0, vocab, (T,), generator=g)  # [T]
    corrupt = clean.clone()
    end = min(first_diff + span, T - n_answer + 1)
    corrupt[first_diff:end] = (corrupt[first_diff:end] + 1 + torch.randint(0, vocab - 1, (end - first_diff,),
                                                                           generator=g)) % vocab
    answer_pos = torch.arange(T - n_answer, T)  # [A]
    clean_ans = torch.randint(0, vocab, (n_answer,), generator=g)  # [A]
    corrupt_ans = (clean_ans + 1 + torch.randint(0, vocab - 1, (n_answer,), generator=g)) % vocab  # [A]
    return SimpleNamespace(clean_ids=clean, corrupt_ids=corrupt, answer_pos=answer_pos, clean_answer_ids=clean_ans,
                           corrupt_answer_ids=corrupt_ans, first_diff=first_diff)


@torch.inference_mode()
def model_pair(model, T: int, first_diff: int, n_answer: int, seed: int, max_effect: bool = False):
    """make_pair with answers read off the model, so that M_clean - M_corrupt is a clear margin.

    Default: clean = argmax of the clean run (the model is "correct"), corrupt = argmax of the corrupted run
    (or the clean run's runner-up). max_effect: the tokens whose logits the corruption lowers / raises most,
    which maximizes the denominator (float32 rounding of ~1e-6 then stays far below the 1e-5 tolerance).
    """
    p = make_pair(T, first_diff, n_answer, seed)
    lc = model(p.clean_ids[None]).logits[0, p.answer_pos]  # [A, V]
    lx = model(p.corrupt_ids[None]).logits[0, p.answer_pos]  # [A, V]
    if max_effect:
        p.clean_answer_ids, p.corrupt_answer_ids = (lc - lx).argmax(-1), (lx - lc).argmax(-1)  # [A], [A]
        return p
    p.clean_answer_ids = lc.argmax(-1)  # [A]
    alt = lx.argmax(-1)  # [A]
    runner_up = lc.topk(2, dim=-1).indices[:, 1]  # [A]
    p.corrupt_answer_ids = torch.where(alt == p.clean_answer_ids, runner_up, alt)  # [A]
    return p
