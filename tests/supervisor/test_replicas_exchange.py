"""The replica groups' peer-to-peer engine (jaxpar/worker/group_exchange.py) on real Gloo, in one
child process with jaxpar[gloo] on its PYTHONPATH (tests/support/gloo_peer.py): three members sum
and average like the hub; a stranger at the rendezvous store changes nothing; a member that never
comes ends the exchange at its timeout, and the rest re-form without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import gloo_peer
from tests.support.helpers import cpu_env
from tests.support.launch_util import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPT = os.path.join(REPO, "tests", "support", "exchange_script.py")


def test_gloo_exchange_averages_ignores_a_stranger_and_ends_at_its_timeout():
    env = {**cpu_env(devices=None), "PYTHONPATH": os.pathsep.join([str(REPO), gloo_peer.site()]),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True,
                       timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(s and s.startswith("127.0.0.1:") for s in out["stores"]), out
    # the mean of (1, 2, 3) x arange(4), and of the int32 leaf (6 // 3), on every member
    for g in "012":
        assert out["all"][g] == {"0": [0.0, 2.0, 4.0, 6.0], "1": [[2, 2, 2]] * 2}, out["all"]
    # a member missing from the exchange: the others fail at its 3 s timeout, not later
    for g in "01":
        assert out["missing"][g]["error"] in ("RuntimeError", "DistStoreError"), out["missing"]
        assert out["missing"][g]["seconds"] < 30, out["missing"]
        assert out["left"][g] == {"0": [0.0, 1.5, 3.0, 4.5], "1": [[1, 1, 1]] * 2}, out["left"]
    assert out["digest_equal"]
