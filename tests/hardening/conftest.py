"""Fixtures of the hardening tests."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def small_fs(tmp_path):
    """A 6 MiB tmpfs (root may mount); the test says why if this machine does not allow it."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()}): needs root")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)
