"""research/nope_init.py: stage 1's alignment loss at conversion, per FA-branch variant (tiny windows, CPU)."""
import json

import pytest

from headscope.evaluate.fidelity_data import list_sources
from research import nope_init

REF_MASK = "docs/results/2026-12-02_reference_hybrid_training/ref_mask.json"


def test_variants_share_the_gdn_start_and_rope_is_the_teachers_fa(tmp_path, capsys):
    out = tmp_path / "n.json"
    res = nope_init.main(["--model", "default", "--mask", REF_MASK, "--windows", "2", "--length", "64",
                          "--variants", "rope,nope_copy,nope_log_copy", "--json", str(out)])
    loss = res["loss"]
    assert set(loss) == {"rope", "nope_copy", "nope_log_copy"} and all(v > 0 for v in loss.values())
    assert loss["nope_copy"] != loss["rope"]  # only the FA branch differs; the GDN heads start the same
    again = nope_init.main(["--model", "default", "--mask", REF_MASK, "--windows", "2", "--length", "64",
                            "--variants", "rope"])
    assert again["loss"]["rope"] == pytest.approx(loss["rope"])  # the same seed: the same start
    assert json.loads(out.read_text())["mask"] == REF_MASK  # the repository's path, not this machine's
    assert res["sources"] == list_sources()[:2]  # one window per held-out source, in the manifest's order
    assert "vs rope" in capsys.readouterr().out


def test_an_unknown_variant_is_named():
    with pytest.raises(SystemExit):
        nope_init.main(["--variants", "rope,nope_zero"])
