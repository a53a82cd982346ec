"""How the suite is spread over pytest-xdist workers (`--dist loadgroup`, pyproject.toml)."""

from __future__ import annotations

import os

import pytest

# The cluster tests share one worker: they start one SLURM cluster and namespace hosts with fixed
# addresses (never two at once). Every other module is a group of its own (module fixtures built
# once) or shares one with the modules that build its programs (SHARED), unless a test names its
# group (`pytest.mark.xdist_group`). The longest groups start first so that no worker is left with
# a long tail: wall seconds per group from `JAXPAR_TEST_CPU_LOG` of a whole run on a 2-core
# machine (4 workers), rounded (a wrong figure only changes the order).
CLUSTER = "cluster"
# test_pipeline.py's tests that run in child processes form a group of their own (the module's
# two halves run on two workers).
PIPELINE_CHILDREN = "parallel/test_pipeline.py:children"
# ... and those that compile whole train steps of their own (memory, inspect, checkpoint chains)
PIPELINE_WHOLE_STEPS = "parallel/test_pipeline.py:whole_steps"
PIPELINE_REST = "parallel/test_pipeline.py"
# Modules that compile and train the same gpt_tiny layouts through conftest's session fixtures
# (`compiled`, `runs`: dp8, fsdp8, dp2_tp4 of 5 steps): one group, so that one worker compiles and
# trains each of them once for all three.
GPT_TINY_LAYOUTS = "gpt_tiny_layouts"
# Hugging Face checkpoints (tests/hf): one worker makes the peer's reference models once.
HF = "hf"
SHARED = {
    "parallel/test_parity.py": GPT_TINY_LAYOUTS,
    "engine/test_precision.py": GPT_TINY_LAYOUTS,
    "parallel/test_step_audit.py": GPT_TINY_LAYOUTS,
    "hf/test_hf_files.py": HF,
    "hf/test_hf_parity.py": HF,
    "hf/test_hf_cli.py": HF,
}
LONGEST_FIRST = {
    CLUSTER: 365,
    PIPELINE_REST: 330,
    GPT_TINY_LAYOUTS: 305,  # test_precision + test_parity + test_step_audit
    "tools/test_doctor.py": 290,
    "bench/test_bench_recovery.py": 200,
    "parallel/test_context.py": 195,
    "recovery/test_local_resume_2proc.py": 180,
    "models/test_llama.py": 180,
    "supervisor/test_replicas.py": 175,
    "recovery/test_checkpoint_faults.py": 165,
    PIPELINE_WHOLE_STEPS: 145,
    PIPELINE_CHILDREN: 125,
    "bench/test_bench_quick.py": 95,
    "supervisor/test_supervisor.py": 95,
    "parallel/test_comm.py": 80,
    "parallel/test_stage_layers.py": 80,
    HF: 75,  # tests/hf; a machine's first run also installs the peer (~165 s)
    "api/userproj/test_userproj.py": 75,
    "data/test_data_e2e.py": 70,
    "recovery/test_resume_2proc.py": 70,
    "supervisor/test_replicas_hosts.py": 60,
    "recovery/test_context_reshard.py": 55,
    "bench/test_bench_survivors.py": 50,
    "supervisor/test_standby_teardown.py": 45,
    "bench/test_bench_context.py": 45,
    "engine/test_experts.py": 45,
    "api/test_install.py": 40,
    "parallel/test_moe.py": 40,
    "supervisor/test_supervisor_fake.py": 40,
    "api/test_notebook.py": 30,
    "api/test_train_cli.py": 25,
}


def group_of(item: pytest.Item, repo: str) -> str:
    """The test's xdist group: its own `xdist_group` marker, else its module's (SHARED, the
    cluster, or the module itself)."""
    marker = item.get_closest_marker("xdist_group")
    if marker is not None:
        return marker.args[0] if marker.args else marker.kwargs["name"]
    rel = os.path.relpath(str(item.path), os.path.join(repo, "tests")).split(os.sep)
    return CLUSTER if rel[0] == CLUSTER else SHARED.get("/".join(rel), "/".join(rel))
