"""Fixtures for the cluster-engine tests: network-namespace hosts and a real SLURM cluster.

A test needing something this machine lacks skips with the reason, except under CI
(JAXPAR_REQUIRE_CLUSTER=1, set by .ci/run), where the same reason fails the test: CI must run
every `slurm` and `netns` test.
"""

from __future__ import annotations

import os

import pytest

from tests.support.netns_hosts import Hosts, netns_unavailable
from tests.support.slurm_cluster import SlurmCluster, ensure_installed

REQUIRE = "JAXPAR_REQUIRE_CLUSTER"


def unavailable(reason: str | None) -> None:
    if reason is None:
        return
    if os.environ.get(REQUIRE) == "1":
        pytest.fail(f"{reason} ({REQUIRE}=1: cluster tests must run here)")
    pytest.skip(reason)


@pytest.fixture
def hosts2():
    """Two network-namespace hosts (h0, h1) for one test; everything on them dies after it."""
    unavailable(netns_unavailable())
    with Hosts(2) as hosts:
        yield hosts


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """A two-node SLURM cluster (nodes h0 and h1 on namespace hosts) for the session."""
    unavailable(netns_unavailable())
    unavailable(ensure_installed())
    with Hosts(2) as hosts, SlurmCluster(hosts, tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
