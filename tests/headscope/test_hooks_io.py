import os

import pytest
import torch
import torch.nn as nn

from headscope.hooks import Hook, hooks, post, pre, record_inputs
from headscope.io import OutputExistsError, atomic_write, check_output_path, write_text


def _n_hooks(m: nn.Module) -> int:
    return len(m._forward_pre_hooks) + len(m._forward_hooks)


def test_hooks_run_and_are_removed():
    lin = nn.Linear(3, 3)
    seen = []
    with hooks(pre(lin, lambda m, a: seen.append("pre")), post(lin, lambda m, a, o: seen.append("post"))):
        lin(torch.ones(1, 3))
        assert _n_hooks(lin) == 2
    assert seen == ["pre", "post"] and _n_hooks(lin) == 0


def test_hooks_removed_on_error_and_accept_iterables():
    mods = [nn.Linear(2, 2) for _ in range(3)]
    with pytest.raises(RuntimeError, match="boom"):
        with hooks(pre(m, lambda *a: None) for m in mods):
            assert all(_n_hooks(m) == 1 for m in mods)
            raise RuntimeError("boom")
    assert all(_n_hooks(m) == 0 for m in mods)


def test_hooks_bad_input():
    with pytest.raises(TypeError, match="Hook values"):
        with hooks("not a hook"):
            pass
    with pytest.raises(ValueError, match="kind"):
        Hook(nn.Linear(1, 1), lambda *a: None, kind="backward")
    with pytest.raises(TypeError, match="nn.Module"):
        pre(object(), lambda *a: None)


def test_pre_hook_with_kwargs_can_replace_input():
    lin = nn.Linear(2, 2, bias=False)
    with hooks(pre(lin, lambda m, args, kw: ((torch.zeros_like(args[0]),), kw), with_kwargs=True)):
        assert lin(torch.ones(1, 2)).abs().sum() == 0


def test_record_inputs_copies_first_inputs_and_cleans_up():
    mods = [nn.Linear(2, 2) for _ in range(2)]
    x = torch.arange(12.).view(1, 6, 2)  # [B, T, C]
    with record_inputs(mods, start=2) as by_index, record_inputs({"b": mods[1]}) as by_key:
        y = mods[1](mods[0](x))
        assert all(_n_hooks(m) == 2 for m in mods[1:]) and _n_hooks(mods[0]) == 1
    assert all(_n_hooks(m) == 0 for m in mods)
    assert torch.equal(by_index[0], x[:, 2:]) and torch.equal(by_key["b"], mods[0](x).detach())
    assert not by_key["b"].requires_grad and by_index[1].data_ptr() != y.data_ptr()
    x[0, 2, 0] = -1.0  # a copy: later edits of the input do not reach the record
    assert by_index[0][0, 0, 0] == 4.0


def test_atomic_write_keeps_old_file_on_failure(tmp_path):
    p = tmp_path / "a.json"
    write_text(p, "old")
    with pytest.raises(RuntimeError):
        with atomic_write(p) as f:
            f.write("half")
            raise RuntimeError("killed")
    assert p.read_text() == "old"
    assert [x.name for x in tmp_path.iterdir()] == ["a.json"]  # no temporary left behind
    write_text(p, "new")
    assert p.read_text() == "new"


def test_atomic_write_fsyncs_unless_told_not_to(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    write_text(tmp_path / "a.txt", "kept")
    assert len(synced) == 1
    write_text(tmp_path / "b.txt", "part", fsync=False)  # still renamed into place whole, not forced to disk
    assert len(synced) == 1 and (tmp_path / "b.txt").read_text() == "part"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a.txt", "b.txt"]


def test_atomic_write_refuses_folder(tmp_path):
    with pytest.raises(IsADirectoryError):
        write_text(tmp_path, "x")


def test_check_output_path(tmp_path):
    mask = tmp_path / "mask.json"
    check_output_path(mask, kind="headscope.head_mask")  # missing: fine
    mask.write_text('{"schema": "headscope.head_mask"}')
    check_output_path(mask, kind="headscope.head_mask")  # same kind: overwritten freely
    other = tmp_path / "notes.json"
    other.write_text("my notes")
    with pytest.raises(OutputExistsError, match="--overwrite"):
        check_output_path(other, kind="headscope.head_mask")
    check_output_path(other, kind="headscope.head_mask", overwrite=True)
    with pytest.raises(IsADirectoryError, match="folder"):
        check_output_path(tmp_path)
    with pytest.raises(ValueError, match=".html"):
        check_output_path(tmp_path / "fig.txt", suffixes=(".html", ".png"))


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_written_files_and_folders_follow_the_umask(tmp_path, mask):
    """Outputs get the mode a plain open()/mkdir() gives (not mkstemp's 0600 / mkdtemp's 0700), so a teammate can
    read a mask, results or weights written under umask 022."""
    import os
    import stat

    from headscope.io import make_temp_dir, umask, write_bytes, write_text

    old = os.umask(mask)
    try:
        assert umask() == mask
        f = write_text(tmp_path / "mask.json", "{}")
        b = write_bytes(tmp_path / "w.bin", b"\0")
        d = make_temp_dir(tmp_path, prefix=".results.")
    finally:
        os.umask(old)
    assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask == stat.S_IMODE(b.stat().st_mode)
    assert stat.S_IMODE(d.stat().st_mode) == 0o777 & ~mask
