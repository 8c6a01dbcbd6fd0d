"""research/decode_levers.sh: an unknown part is refused with the list, and its parts run what the decode jobs run
(the same bench and count flags as bench_decode_best and decode_time_split, the same test selection as
gpu_tests_pdl)."""
import re
import subprocess
from pathlib import Path

from research.launch import get_job

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "research" / "decode_levers.sh"


def _array(name: str) -> list[str]:
    m = re.search(rf"^{name}=\((.*?)\)$", SCRIPT.read_text(), re.M | re.S)
    return m.group(1).split()


def test_an_unknown_part_is_refused_with_the_list():
    r = subprocess.run(["bash", str(SCRIPT), "nope"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "unknown part 'nope'" in r.stderr and "split_pdl" in r.stderr


def test_the_parts_run_the_jobs_flags():
    def without_budget(args):
        args = [str(a) for a in args]
        i = args.index("--budget-s")
        return args[:i] + args[i + 2:]

    assert without_budget(_array("BENCH")) == without_budget(get_job("bench_decode_best").args)
    assert _array("SPLIT") == [str(a) for a in get_job("decode_time_split").args]
    selection = get_job("gpu_tests_pdl").args
    text = SCRIPT.read_text()
    assert all(path in text for path in selection[:3]) and f'-k "{selection[-1]}"' in text
