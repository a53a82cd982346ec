"""The local snapshot tier's trust boundary: a root folder another user owns or can write is
refused with one line naming the fix; planted symlinks are never followed; snapshots are private
(0700 folders, 0600 files); a forged snapshot (bytes edited, CRCs recomputed), a file of another
user or a forged peer copy is refused and the run falls back with a line and an event; a restart
that finds only torn snapshots and no checkpoint says it starts from step 0; peer copies held on
a node are removed when the job completes. Another user is simulated with chown to uid
65534 (as root; the tests that need it are skipped for other users).

    python -m pytest tests/recovery/test_local_tier_trust.py
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from test_snapshot_peer_unit import TOKEN, _peers
from test_snapshot_unit import _abstract, _events, _mesh, _state, _tier

from jaxpar.recovery import local_tier, peer_tier, tiers
from jaxpar.recovery import local_tier_store as store
from jaxpar.recovery.local_tier_store import DATA, MARKER, UnsafeFolder, load_bytes
from jaxpar.rundir.writer import RunDir

NOBODY = 65534


def _chown_to_another_user(path) -> None:
    """chown to uid 65534; only root may, so elsewhere the test is skipped."""
    if os.geteuid() != 0:
        pytest.skip("simulating another user's file needs root (chown)")
    os.chown(path, NOBODY, NOBODY)


@pytest.fixture
def saved(tmp_path):
    """Steps 2 and 3 committed by one process (8 devices), and the states."""
    run = RunDir(str(tmp_path / "run"))
    abstract = _abstract(_mesh())
    tier = _tier(run, abstract, tmp_path / "local")
    tier.restore(None)
    states = {s: _state(abstract, s) for s in (1, 2, 3)}
    for s, st in states.items():
        tier.offer(s, st)
    tier.close()
    return SimpleNamespace(run=run, abstract=abstract, root=tmp_path / "local", tier=tier,
                           states=states)  # fmt: skip


def _slot(saved, step: int) -> str:
    return saved.tier.own.dirs[saved.tier.own.find(step)]


def _forge(slot: str) -> None:
    """What a user who can write the folder does: edit the arrays, recompute the CRCs."""
    path = os.path.join(slot, DATA)
    data = bytearray(open(path, "rb").read())
    data[:4] = b"\x7f\x7f\x7f\x7f"
    open(path, "wb").write(data)
    with open(os.path.join(slot, MARKER)) as f:
        marker = json.load(f)
    for e in marker["blocks"]:
        e["crc"] = zlib.crc32(data[e["offset"] : e["offset"] + e["nbytes"]])
    with open(os.path.join(slot, MARKER), "w") as f:
        json.dump(marker, f)


def _tiers_view(run, snapshots) -> tiers.LocalSnapshotTier:
    """The tier as the training loop sees it (restore, started_from), around `snapshots`."""
    t = object.__new__(tiers.LocalSnapshotTier)
    t.setup = SimpleNamespace(run=run, cfg=SimpleNamespace(ckpt=SimpleNamespace(restore="latest")))
    t.snapshots, t.fallback = snapshots, None
    return t


def _restart(saved, capsys) -> tuple[object, str]:
    """A restart with no persistent checkpoint: (restored or None, the console's lines)."""
    view = _tiers_view(saved.run, _tier(saved.run, saved.abstract, saved.root))
    restored = view.restore(None, tiers.Attempt())
    view.started_from(restored, restored.state if restored else {"step": np.int32(0)})
    return restored, capsys.readouterr().err


# ---- the folders ------------------------------------------------------------------------------


ATTACKS = ["other_owner", "mode_0777", "symlink", "parent_0777"]


def _plant(tmp_path, attack: str):
    """The root folder tmp_path/shm/jaxpar-0 as an attack leaves it (its parent sticky)."""
    root = tmp_path / "shm" / "jaxpar-0"
    root.parent.mkdir()
    root.parent.chmod(0o1777)  # as /dev/shm is
    if attack == "other_owner":  # another user created it first (a predictable name)
        root.mkdir(mode=0o700)
        _chown_to_another_user(root)
    elif attack == "mode_0777":
        root.mkdir()
        os.chmod(root, 0o777)
    elif attack == "symlink":
        (tmp_path / "elsewhere").mkdir()
        os.symlink(tmp_path / "elsewhere", root)
    else:  # anyone could swap the folder for their own
        os.chmod(root.parent, 0o777)
    return root


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_root_folder_others_can_write_is_refused_in_one_line(tmp_path, attack):
    root = _plant(tmp_path, attack)
    with pytest.raises(UnsafeFolder) as e:
        _tier(RunDir(str(tmp_path / "run")), _abstract(_mesh()), root)
    msg = str(e.value)
    assert isinstance(e.value, ValueError)  # a worker: "error: ..." and exit 2, no traceback
    assert "\n" not in msg and str(root) in msg and "JAXPAR_LOCAL_DIR" in msg, msg
    assert not os.path.exists(os.path.join(root, "run-" + local_tier.run_key(tmp_path / "run")))


@pytest.mark.parametrize("attack", ATTACKS)
def test_a_squatted_default_root_falls_back_to_a_folder_of_ones_own(tmp_path, monkeypatch,
                                                                     capsys, attack):  # fmt: skip
    """Another local user created the default root /dev/shm/jaxpar-<uid> first (or left a
    symlink, or a folder open to all): the run is not refused; its snapshots go to a folder
    beside it whose name derives from the user's key, said in one line, and the squatted one is
    left alone. Where the parent itself is unsafe the fallback is too: refused as before."""
    root = _plant(tmp_path, attack)
    monkeypatch.setattr(local_tier, "shared_root", lambda: str(root))
    if attack == "parent_0777":
        with pytest.raises(UnsafeFolder, match="its parent is writable by other users"):
            _tier(RunDir(str(tmp_path / "run")), _abstract(_mesh()), root)
        return
    run = RunDir(str(tmp_path / "run"))
    tier = _tier(run, _abstract(_mesh()), root)
    alt = local_tier.private_root(str(root))
    assert tier.root == alt and tier.node.startswith(alt + os.sep)
    assert alt == local_tier.private_root(str(root)) != str(root)  # every process finds it
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert str(root) in line and f"local snapshots go to {alt}" in line, line
    assert stat.S_IMODE(os.stat(alt).st_mode) == 0o700
    tier.restore(None)
    tier.offer(1, _state(tier._abstract, 1))
    tier.close()
    assert os.listdir(alt) and not os.path.islink(alt)
    if attack == "symlink":
        assert os.listdir(tmp_path / "elsewhere") == []  # never written through
    elif attack == "mode_0777":
        assert os.listdir(root) == []
    bad = tmp_path / "chosen"  # a folder the user named is refused as before
    bad.mkdir()
    os.chmod(bad, 0o777)
    with pytest.raises(UnsafeFolder, match="is writable by other users"):
        _tier(run, _abstract(_mesh()), bad)


def test_a_planted_symlink_is_never_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    root, run_path = tmp_path / "local", tmp_path / "run"
    node = local_tier.node_dir(str(root), str(run_path))
    for k in (0, 1):  # the victim's next run writes these
        os.makedirs(os.path.join(node, "proc0", f"slot{k}"))
        os.symlink(victim, os.path.join(node, "proc0", f"slot{k}", DATA))
        tmp = f"{MARKER}.tmp.{os.getpid()}"  # the commit marker's temporary file
        os.symlink(victim, os.path.join(node, "proc0", f"slot{k}", tmp))
    abstract = _abstract(_mesh())
    tier = _tier(RunDir(str(run_path)), abstract, root)
    assert tier.restore(None) is None
    for s in (1, 2):
        tier.offer(s, _state(abstract, s))
    tier.close()
    assert victim.read_text() == "precious" and tier.error is None
    for d in tier.own.dirs:
        assert not os.path.islink(os.path.join(d, DATA))


def test_a_planted_symlink_to_a_folder_stops_the_tier_not_the_run(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root, run_path = tmp_path / "local", tmp_path / "run"
    node = local_tier.node_dir(str(root), str(run_path))
    os.makedirs(os.path.join(node, "proc0"))
    os.symlink(outside, os.path.join(node, "proc0", "slot0"))
    run = RunDir(str(run_path))
    abstract = _abstract(_mesh())
    tier = _tier(run, abstract, root)
    tier.restore(None)
    tier.offer(1, _state(abstract, 1))
    tier.close()
    assert os.listdir(outside) == []
    (err,) = _events(run, "snapshot_error")
    assert "slot0" in err["error"] and "not a folder" in err["error"], err


def test_snapshots_are_private_even_in_folders_an_older_jaxpar_left_open(tmp_path):
    root, run_path = tmp_path / "local", tmp_path / "run"
    node = local_tier.node_dir(str(root), str(run_path))
    os.makedirs(os.path.join(node, "proc0", "slot0"), mode=0o755)
    for d in (root, node, os.path.join(node, "proc0"), os.path.join(node, "proc0", "slot0")):
        os.chmod(d, 0o755)
    abstract = _abstract(_mesh())
    tier = _tier(RunDir(str(run_path)), abstract, root)
    tier.restore(None)
    for s in (1, 2):
        tier.offer(s, _state(abstract, s))
    tier.close()
    for folder, dirs, files in os.walk(node):
        for d in dirs:
            assert stat.S_IMODE(os.lstat(os.path.join(folder, d)).st_mode) == 0o700, (folder, d)
        for f in files:
            assert stat.S_IMODE(os.lstat(os.path.join(folder, f)).st_mode) == 0o600, (folder, f)
    assert stat.S_IMODE(os.lstat(node).st_mode) == 0o700
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700  # nor the names of its runs


# ---- the snapshots ----------------------------------------------------------------------------


def test_a_forged_snapshot_is_refused_and_the_previous_one_used(saved):
    _forge(_slot(saved, 3))
    got, info = _tier(saved.run, saved.abstract, saved.root).restore(None)
    assert info["step"] == 2 and info["skipped"] == [3] and info["tier"] == "local"
    assert (
        np.asarray(got["params"]["w"]).tobytes()
        == np.asarray(saved.states[2]["params"]["w"]).tobytes()
    )
    (bad,) = _events(saved.run, "snapshot_rejected")
    assert "MAC mismatch" in bad["processes"]["0"], bad


def test_forged_snapshots_fall_back_with_a_line_and_an_event(saved, capsys):
    for step in (2, 3):
        _forge(_slot(saved, step))
    restored, err = _restart(saved, capsys)
    assert restored is None
    (fallback,) = _events(saved.run, "local_fallback")
    assert fallback["to"] == "init" and fallback["skipped"] == [3, 2], fallback
    (line,) = [x for x in err.splitlines() if "no local snapshot usable" in x]
    assert "[3, 2] rejected" in line and "step 0" in line, err


def test_files_of_another_user_are_refused(saved, capsys):
    _chown_to_another_user(os.path.join(_slot(saved, 3), DATA))
    with pytest.raises(OSError, match="belongs to uid 65534"):
        load_bytes(os.path.join(_slot(saved, 3), DATA))
    got, info = _tier(saved.run, saved.abstract, saved.root).restore(None)
    assert info["step"] == 2  # step 3 is not even offered
    (bad,) = _events(saved.run, "snapshot_rejected")
    assert bad["step"] == 3 and bad["reason"] == "data.bin: belongs to uid 65534, not to you", bad
    # commit markers of another user: not even their steps are read; nothing else is there
    for d in saved.tier.own.dirs:
        with open(os.path.join(d, MARKER), "w") as f:
            json.dump({"step": 9}, f)
        _chown_to_another_user(os.path.join(d, MARKER))
    restored, err = _restart(saved, capsys)
    assert restored is None
    (fallback,) = _events(saved.run, "local_fallback")
    assert [u["why"] for u in fallback["unusable"]] == [
        "commit.json: belongs to uid 65534, not to you"
    ] * 2
    assert "step 0" in err and "uid 65534" in err, err


def test_only_torn_snapshots_and_no_checkpoint_say_the_run_starts_from_step_0(saved, capsys):
    for d in saved.tier.own.dirs:
        os.remove(os.path.join(d, MARKER))  # killed mid-write, twice
    assert _tier(saved.run, saved.abstract, saved.root).restore(3) is None  # a checkpoint: quiet
    restored, err = _restart(saved, capsys)
    assert restored is None
    (fallback,) = _events(saved.run, "local_fallback")
    assert fallback["to"] == "init" and len(fallback["unusable"]) == 2, fallback
    assert "torn" in fallback["unusable"][0]["why"]
    (line,) = [x for x in err.splitlines() if "no local snapshot usable" in x]
    assert "torn" in line and "restarting from step 0" in line, err


def test_a_forged_peer_copy_is_refused_at_rest(saved):
    """A peer copy is checked like an own snapshot: the copy held on another node, edited there."""
    tier = _tier(saved.run, saved.abstract, saved.root)
    tier.restore(None)
    slot = _slot(saved, 3)
    genuine = json.load(open(os.path.join(slot, MARKER)))
    copy = (genuine, bytearray(open(os.path.join(slot, DATA), "rb").read()), "")
    tier.peers = SimpleNamespace(fetch=lambda step: copy)
    got, source, why = tier._load(3, own={})
    assert source == "peer" and why == "" and got is not None
    _forge(slot)
    forged = json.load(open(os.path.join(slot, MARKER)))
    copy = (forged, bytearray(open(os.path.join(slot, DATA), "rb").read()), "")
    got, source, why = tier._load(3, own={})
    assert got is None and source == "peer" and "MAC mismatch" in why, why


# ---- peer copies on a node --------------------------------------------------------------------


def test_peer_copies_are_private_and_removed_when_the_job_completes(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAR_COORDINATOR", "127.0.0.1:1")  # the address the server binds
    node = tmp_path / "local" / "run-0123456789abcdef"
    node.mkdir(parents=True)
    server = peer_tier.Server(str(node), nproc=2, limit=1 << 20)
    server.met(TOKEN)
    peers = _peers(server, server.addr)  # process 0 sends its copies to this server
    peers.tier.nproc, peers.tier.node = 2, str(node)
    for step in (1, 2, 3):
        peers.replicate({"step": step, "nbytes": 8, "mac": "m"}, [np.arange(8, dtype=np.uint8)])
    held = node / "peer" / "proc0"
    assert sorted(m["step"] for m in server.slots(0).committed().values()) == [2, 3]
    for p in [held, *held.iterdir()]:
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    for p in held.glob("slot*/*"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    peers.remove_held()  # one process: the exchange with the others is immediate
    peers.close()
    assert not held.exists()
    assert jax.process_count() == 1


def test_invalidated_snapshots_free_their_ram_and_are_not_taken_for_torn(saved, capsys):
    tier = _tier(saved.run, saved.abstract, saved.root)
    assert tier.restore(None)[1]["step"] == 3
    (dropped,) = [d for d in tier.own.dirs if d != _slot(saved, 3)]
    assert os.listdir(dropped) == []  # another timeline: marker and data gone
    tier.forget_except(None)  # e.g. a restart from step 0: every snapshot invalidated
    restored, err = _restart(saved, capsys)
    assert restored is None and not _events(saved.run, "local_fallback") and not err, err


def test_the_mac_covers_every_piece_of_every_block_and_the_marker(monkeypatch):
    monkeypatch.setattr(store, "MAC_PIECE", 7)  # many pieces, hashed on several threads
    key = b"k" * 32
    blocks = [np.arange(20, dtype=np.uint8), np.zeros(0, np.uint8), np.arange(9, dtype=np.uint8)]
    marker = {"step": 4, "blocks": [{"offset": 0, "nbytes": 20}, {"offset": 20, "nbytes": 0},
                                    {"offset": 20, "nbytes": 9}]}  # fmt: skip
    marker["mac"] = store.seal(marker, blocks, key)
    data = bytearray(b"".join(b.tobytes() for b in blocks))
    assert store.authentic(marker, data, key)
    for i in range(len(data)):  # any byte
        forged = bytearray(data)
        forged[i] ^= 1
        assert not store.authentic(marker, forged, key), i
    assert not store.authentic({**marker, "step": 5}, data, key)  # the commit record
    assert not store.authentic(marker, data, b"x" * 32)  # another user's key
    assert not store.authentic({**marker, "blocks": None}, data, key)
