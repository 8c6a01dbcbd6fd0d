"""research/bench_receiver_gpu.py --model on CPU with a tiny folder: the real-model path of the GPU call."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from char_tokenizer import char_tokenizer
from model_factories import tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_real_model_path_writes_json_per_context(tmp_path):
    folder = tmp_path / "tiny_llama"
    tiny_model("llama", attn_implementation="sdpa").save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, str(ROOT / "research" / "bench_receiver_gpu.py"), "--model", str(folder),
                           "--device", "cpu", "--contexts", "150,200", "--n-pairs", "1", "--repeats", "1",
                           "--tl-heads", "2", "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["contexts"]) == {"150", "200"} and res["n_heads"] == 12
    for row in res["contexts"].values():
        assert row["ours_s_per_pair_median"] > 0 and row["n_pairs"] == 1
        if importlib.util.find_spec("transformer_lens") is None:
            assert "tl_ms_per_head_subset" not in row
        else:  # compared, or the failure recorded without costing the next context
            assert "tl_ms_per_head_subset" in row or "tl_error" in row
    if importlib.util.find_spec("transformer_lens") is None:
        assert proc.stdout.count("TransformerLens not installed here: skipped") == 2
    assert proc.stdout.count(f"wrote {out}") == 2  # after each context
