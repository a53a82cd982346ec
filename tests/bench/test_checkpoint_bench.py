"""`jaxpar bench checkpoint --quick` runs end to end (in process, 8 devices) and reports.

No assertion on timings (they belong to the benchmark, not the tests): only that every figure
is measured (the local snapshot tier's price too), the table is printed and checkpoint.json
written.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxpar.bench import checkpoint
from jaxpar.bench.harness import Bench

# gpt_tiny with one layer (its layers are stacked: the same state tree, 55 arrays) on sequences
# of 32: a state of ~3 MB, still more than the 1 MB asserted below, whose training steps (about
# 20, most of the run's CPU) cost a fraction of the four layers'
SMALLER = ("model.n_layers=1", "model.seq_len=32", "data.seq_len=32")


@pytest.mark.slow
def test_quick_checkpoint_bench_reports_blocking_and_throughput(tmp_path, capsys, devices8):
    result = checkpoint.run(Bench.create(overrides=SMALLER, quick=True, out_dir=str(tmp_path)))
    table = capsys.readouterr().out
    assert "| sync / async blocking |" in table and "| throughput cost of saving |" in table
    with open(tmp_path / "checkpoint.json") as f:
        assert json.load(f) == json.loads(json.dumps(result))
    assert result["devices"] == 8 and result["mesh"] == "data=8"
    assert result["state_mb"] > 1
    for key in ("async_blocking_s", "sync_blocking_s", "async_commit_s"):
        assert result[key] > 0, key
    plan = checkpoint.QUICK
    assert result["saves"] == plan["rounds"]
    assert result["tokens_per_s_no_saves"] > 0 and result["tokens_per_s_with_saves"] > 0
    assert not list(tmp_path.glob("checkpoint-bench"))  # its checkpoints are removed
    # the local tier: a snapshot after every step of the "on" blocks (+1 outside timing), both
    # kinds of block timed, and its snapshots removed from RAM afterwards
    assert "| local tier on / off |" in table
    assert result["local_tier_snapshots"] == plan["rounds"] * plan["every"] + 1
    assert result["step_s_local_tier_on"] > 0 and result["step_s_local_tier_off"] > 0
    assert result["local_tier_step_ratio"] > 0 and result["local_tier_bytes_per_process"] > 1e6
    assert not os.path.exists(result["local_tier_dir"])
