"""headscope.evaluate.teacher_cache: the teacher's side of the fidelity suite kept on disk. A second student reads
it back (the same rows as without the cache), another teacher or other inputs do not, rows cut short are not kept."""
import copy

import pytest
import torch

import headscope
from headscope.evaluate.teacher_cache import TeacherCache, weights_digest

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def teacher():
    return tiny_model("qwen3")


def _noisy(model, seed: int):
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.model.layers[1].mlp.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return m


def test_a_value_is_computed_once_per_teacher_and_key(teacher, tmp_path):
    calls = []

    def fn():
        calls.append(1)
        return {"answers": [[1, 2], [3]], "nll": [0.5, 1.25]}

    cache = TeacherCache(tmp_path / "c", teacher)
    assert cache.run("chat", {"prompts": [[1]]}, fn) == fn() and len(calls) == 2  # computed, then fn() here
    assert cache.run("chat", {"prompts": [[1]]}, fn) == {"answers": [[1, 2], [3]], "nll": [0.5, 1.25]}
    assert len(calls) == 2 and (cache.hits, cache.misses) == (1, 1)
    cache.run("chat", {"prompts": [[2]]}, fn)  # other inputs
    TeacherCache(tmp_path / "c", _noisy(teacher, 0)).run("chat", {"prompts": [[1]]}, fn)  # another teacher
    assert len(calls) == 4
    # not kept when keep() says so; a damaged entry is computed again
    TeacherCache(tmp_path / "d", teacher).run("niah", 1, lambda: [{"status": "skipped"}], keep=lambda v: False)
    assert not (tmp_path / "d").exists()
    for f in (tmp_path / "c").glob("chat-*.json"):
        f.write_text("{not json")
    TeacherCache(tmp_path / "c", teacher).run("chat", {"prompts": [[1]]}, fn)
    assert len(calls) == 5


def test_the_digest_follows_the_weights_and_a_file_is_refused(teacher, tmp_path):
    assert weights_digest(teacher) == weights_digest(copy.deepcopy(teacher)) != weights_digest(_noisy(teacher, 1))
    m = copy.deepcopy(teacher)  # remembered per model, but not past a change in place
    before = weights_digest(m)
    with torch.no_grad():
        next(m.parameters()).add_(1.0)
    assert weights_digest(m) != before
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="give a folder"):
        TeacherCache(tmp_path / "f", teacher)


def test_a_second_student_reads_the_teachers_side_back_with_the_same_rows(teacher, tmp_path):
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    src = tmp_path / "prose.txt"
    src.write_text(headscope.evaluate.fidelity_data.load_source("shakespeare")[1][:12_000], encoding="utf-8")
    cfg = {"fidelity_continuation": {"sources": [str(src)], "prefix": 32, "new_tokens": 16, "n": 3},
           "fidelity_chat": {"n": 4, "max_new_tokens": 8},
           "fidelity_niah": {"sources": [str(src)], "lengths": (160,), "n": 2}}
    suite = list(cfg)
    student = _noisy(teacher, 2)
    plain = headscope.evaluate(student, suite, tok, teacher=teacher, configs=cfg, progress=False)
    first = headscope.evaluate(student, suite, tok, teacher=teacher, configs=cfg, progress=False,
                               teacher_cache=tmp_path / "tc")
    assert first.attrs["meta"]["teacher_cache"]["read"] == 0
    assert first.attrs["meta"]["teacher_cache"]["computed"] == 3  # one source's continuations, chat, NIAH
    again = headscope.evaluate(student, suite, tok, teacher=teacher, configs=cfg, progress=False,
                               teacher_cache=tmp_path / "tc")
    assert (again.attrs["meta"]["teacher_cache"]["read"], again.attrs["meta"]["teacher_cache"]["computed"]) == (3, 0)
    cols = ["evaluation", "metric", "value", "n", "family", "context_length", "status"]
    for df in (first, again):
        assert df[cols].equals(plain[cols])
    # a new seed builds other NIAH prompts: the teacher's NIAH runs again, the rest is read back
    other = headscope.evaluate(student, suite, tok, teacher=teacher, configs=cfg, progress=False, seed=1,
                               teacher_cache=tmp_path / "tc")
    assert other.attrs["meta"]["teacher_cache"]["computed"] == 1
