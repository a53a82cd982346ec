"""Clean-up of the local snapshot tier: stale folders go at start, nothing else is touched, and a
run directory made again at the same path never restores the old one's snapshots.

    python -m pytest tests/recovery/test_snapshot_clean.py
"""

from __future__ import annotations

import os
import shutil

from test_snapshot_unit import _abstract, _events, _mesh, _state, _tier

from jaxpar.recovery import local_tier, local_tier_clean
from jaxpar.rundir.writer import RunDir


def _node(root, run_path) -> str:
    return local_tier.node_dir(str(root), str(run_path))


def _claimed(root, run_path) -> str:
    """A node folder of `run_path` as a run writes it: marker, one process's slot data."""
    run_path.mkdir(parents=True, exist_ok=True)
    node = _node(root, run_path)
    local_tier_clean.claim(node, str(run_path), local_tier_clean.run_id(str(run_path)))
    os.makedirs(os.path.join(node, "proc0", "slot0"))
    with open(os.path.join(node, "proc0", "slot0", "data.bin"), "wb") as f:
        f.write(b"\0" * 64)
    return node


def test_run_id_is_created_once_and_garbage_is_replaced(tmp_path):
    first = local_tier_clean.run_id(str(tmp_path))
    assert local_tier_clean.run_id(str(tmp_path)) == first == local_tier_clean.read_run_id(tmp_path)
    assert sorted(os.listdir(tmp_path)) == [local_tier_clean.RUN_ID_FILE]  # no temporary file
    (tmp_path / local_tier_clean.RUN_ID_FILE).write_bytes(b"\xff garbage")
    assert local_tier_clean.read_run_id(str(tmp_path)) is None
    again = local_tier_clean.run_id(str(tmp_path))
    assert again != first and local_tier_clean.read_run_id(str(tmp_path)) == again


def test_stale_folders_go_and_nothing_else_is_touched(tmp_path):
    root, runs = tmp_path / "local", tmp_path / "runs"
    root.mkdir()
    live = _claimed(root, runs / "live")  # its run directory exists: kept
    gone = _claimed(root, runs / "gone")
    shutil.rmtree(runs / "gone")  # deleted: nobody can restore from it
    remade = _claimed(root, runs / "remade")
    shutil.rmtree(runs / "remade")
    (runs / "remade").mkdir()
    local_tier_clean.run_id(str(runs / "remade"))  # made again, started once: another run
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    os.symlink(outside, os.path.join(gone, "proc0", "link"))  # inside a removed folder
    no_marker = root / "run-0123456789abcdef"  # not claimed (an older jaxpar, or not ours)
    (no_marker / "proc0").mkdir(parents=True)
    linked = _claimed(tmp_path / "elsewhere", runs / "linked")
    shutil.rmtree(runs / "linked")  # stale, but reached through a symlink: not followed
    os.symlink(linked, root / "run-fedcba9876543210")
    (root / "other-tool").mkdir()

    this = runs / "this"
    this.mkdir()
    node = _node(root, this)
    local_tier_clean.claim(node, str(this), local_tier_clean.run_id(str(this)))  # an earlier start
    os.makedirs(os.path.join(node, "proc3", "slot0"))  # a process index the job no longer has
    os.makedirs(os.path.join(node, "peer", "proc2"))
    os.makedirs(os.path.join(node, "peer", "proc1"))
    ident, removed = local_tier_clean.prepare(str(root), node, str(this), nproc=2)

    assert sorted(removed) == sorted([
        gone, remade, os.path.join(node, "proc3"), os.path.join(node, "peer", "proc2")
    ])  # fmt: skip
    assert not os.path.exists(gone) and not os.path.exists(remade)
    assert (outside / "keep.txt").read_text() == "keep"
    assert os.path.isdir(os.path.join(live, "proc0", "slot0"))
    assert (no_marker / "proc0").is_dir() and (root / "other-tool").is_dir()
    assert os.path.isdir(os.path.join(linked, "proc0")) and os.path.islink(
        root / "run-fedcba9876543210"
    )
    assert os.path.isdir(os.path.join(node, "peer", "proc1"))
    owner = local_tier_clean._owner(node)
    assert owner["run_id"] == ident == local_tier_clean.read_run_id(str(this))
    assert owner["run_dir"] == os.path.realpath(this)


def test_a_run_directory_made_again_never_restores_the_old_snapshots(tmp_path):
    abstract = _abstract(_mesh())
    root, path = tmp_path / "local", tmp_path / "run"
    old = _tier(RunDir(str(path)), abstract, root)
    assert old.restore(None) is None
    for step in (1, 2):
        old.offer(step, _state(abstract, step))
    old.close()  # stopped, not complete: the snapshots stay for a resume
    assert _tier(RunDir(str(path)), abstract, root).restore(None)[1]["step"] == 2
    shutil.rmtree(path)  # the user deletes the run directory and starts again at that path
    run = RunDir(str(path))
    fresh = _tier(run, abstract, root)
    assert fresh.restore(None) is None
    (cleaned,) = _events(run, "local_tier_cleaned")
    assert cleaned["removed"] == [fresh.node] and cleaned["count"] == 1
    assert not os.path.exists(fresh.own.root)  # the old snapshots are gone
    fresh.offer(3, _state(abstract, 3))
    fresh.close(complete=True)  # a finished run leaves nothing behind
    assert not os.path.exists(fresh.node)
