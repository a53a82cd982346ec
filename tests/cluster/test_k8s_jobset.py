"""deploy/k8s/jobset.yaml checked without a Kubernetes cluster: the JobSet, Job, pod and container
fields it uses (against the v1alpha2 JobSet and batch/v1 field sets), its command line as the
pod's shell expands it, parsed by `jaxpar launch`'s own parser, and the environment each pod's
processes see (an Indexed Job's JOB_COMPLETION_INDEX; jaxpar's explicit variables win in workers).

    python -m pytest tests/cluster/test_k8s_jobset.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from jaxpar import cli
from jaxpar.worker import bootstrap
from tests.support.helpers import REPO

MANIFEST = REPO / "deploy" / "k8s" / "jobset.yaml"

# Fields each object may carry (JobSet v1alpha2 API reference; Kubernetes batch/v1 and core/v1).
JOBSET = {"apiVersion", "kind", "metadata", "spec"}
JOBSET_SPEC = {"replicatedJobs", "network", "successPolicy", "failurePolicy", "startupPolicy",
               "suspend", "coordinator", "managedBy", "ttlSecondsAfterFinished"}  # fmt: skip
NETWORK = {"enableDNSHostnames", "subdomain", "publishNotReadyAddresses"}
FAILURE_POLICY = {"maxRestarts", "restartStrategy", "rules"}
REPLICATED_JOB = {"name", "groupName", "template", "replicas", "dependsOn"}
JOB_SPEC = {"parallelism", "completions", "completionMode", "backoffLimit", "backoffLimitPerIndex",
            "maxFailedIndexes", "activeDeadlineSeconds", "ttlSecondsAfterFinished", "template",
            "podFailurePolicy", "podReplacementPolicy", "suspend", "selector", "manualSelector"}  # fmt: skip
POD_SPEC = {"containers", "initContainers", "restartPolicy", "terminationGracePeriodSeconds",
            "volumes", "nodeSelector", "tolerations", "affinity", "serviceAccountName",
            "hostNetwork", "subdomain", "hostname", "priorityClassName", "securityContext"}  # fmt: skip
CONTAINER = {"name", "image", "imagePullPolicy", "command", "args", "workingDir", "env", "envFrom",
             "ports", "resources", "volumeMounts", "securityContext"}  # fmt: skip


def _only(obj: dict, allowed: set[str], where: str) -> None:
    unknown = set(obj) - allowed
    assert not unknown, f"{where}: fields {sorted(unknown)} are not in the API"


@pytest.fixture(scope="module")
def jobset() -> dict:
    (doc,) = list(yaml.safe_load_all(MANIFEST.read_text()))
    return doc


def _parts(js: dict) -> tuple[dict, dict, dict, dict]:
    rjob = js["spec"]["replicatedJobs"][0]
    job = rjob["template"]["spec"]
    pod = job["template"]["spec"]
    return rjob, job, pod, pod["containers"][0]


def test_jobset_fields(jobset):
    _only(jobset, JOBSET, "JobSet")
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    spec = jobset["spec"]
    _only(spec, JOBSET_SPEC, "JobSet.spec")
    _only(spec["network"], NETWORK, "spec.network")
    _only(spec["failurePolicy"], FAILURE_POLICY, "spec.failurePolicy")
    assert len(spec["replicatedJobs"]) == 1
    rjob, job, pod, container = _parts(jobset)
    _only(rjob, REPLICATED_JOB, "replicatedJobs[0]")
    _only(job, JOB_SPEC, "replicatedJobs[0].template.spec")
    _only(pod, POD_SPEC, "pod spec")
    _only(container, CONTAINER, "container")
    # One Indexed Job: pod i is host i; no pod is retried alone (a lost pod ends the agents and
    # the JobSet restarts every pod, which resume from the shared checkpoints).
    assert rjob["replicas"] == 1
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert int(spec["failurePolicy"]["maxRestarts"]) >= 1
    # the preemption save (SIGTERM, then a coordinated checkpoint) needs its time
    assert pod["terminationGracePeriodSeconds"] >= 60
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"] for v in pod["volumes"]}
    assert set(mounts) <= volumes
    assert all(isinstance(e["value"], str) for e in container["env"] if "value" in e)


def _pod_env(jobset: dict, index: int) -> dict[str, str]:
    """The container's environment as Kubernetes gives it (manifest env + the Indexed Job's)."""
    _, job, _, container = _parts(jobset)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXPAR_")}
    env.update({e["name"]: e["value"] for e in container["env"] if "value" in e})
    name = f"{jobset['metadata']['name']}-{jobset['spec']['replicatedJobs'][0]['name']}-0-{index}"
    env.update({"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": name})
    return env


def _argv_as_pod_runs_it(jobset: dict, index: int, tmp_path) -> list[str]:
    """The container's command + args run by bash with the pod's environment; `jaxpar` on PATH
    is a script that prints the argv it receives (the real shell does the expanding)."""
    _, _, _, container = _parts(jobset)
    shim = tmp_path / "bin" / "jaxpar"
    shim.parent.mkdir(exist_ok=True)
    printer = "import json, sys; print(json.dumps(sys.argv[1:]))"
    shim.write_text(f"#!/bin/sh\nexec {sys.executable} -c '{printer}' \"$@\"\n")
    shim.chmod(0o755)
    env = _pod_env(jobset, index)
    env["PATH"] = f"{shim.parent}:{env['PATH']}"
    proc = subprocess.run([*container["command"], *container["args"]], env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("index", [0, 1])
def test_command_parses_with_jaxpar_launch(jobset, index, tmp_path):
    _, job, _, container = _parts(jobset)
    argv = _argv_as_pod_runs_it(jobset, index, tmp_path)
    assert argv[0] == "launch"
    args = cli.build_parser().parse_args(argv)
    opts = cli.launch_options(args)
    assert (opts.nnodes, opts.node_rank) == (job["parallelism"], index)
    # pod 0 of the JobSet's headless service is the leader: <jobset>-<rjob>-0-0.<subdomain>
    name, rjob = jobset["metadata"]["name"], jobset["spec"]["replicatedJobs"][0]["name"]
    subdomain = jobset["spec"]["network"].get("subdomain", name)
    assert jobset["spec"]["network"]["enableDNSHostnames"] is True
    assert opts.bind_host == "0.0.0.0"  # pod 0's own service name may not resolve at its start
    host, port = opts.coordinator.rsplit(":", 1)
    assert host == f"{name}-{rjob}-0-0.{subdomain}"
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    env = _pod_env(jobset, index)
    assert opts.nproc == int(env["NPROC_PER_NODE"])
    assert opts.nproc * opts.devices_per_proc == int(
        container["resources"]["limits"]["nvidia.com/gpu"]
    )
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(opts.run_dir.startswith(m.rstrip("/") + "/") for m in mounts), opts.run_dir
    assert opts.command[:3] == ["python", "-m", "train"]


def test_indexed_job_environment_detection(jobset):
    """In a pod, JOB_COMPLETION_INDEX is the host index: the agent's workers still take the
    process id jaxpar launch gives them; a pod running `python -m train` directly (no agent,
    JAXPAR_COORDINATOR + JAXPAR_NUM_PROCESSES in the manifest) takes the index as its id."""
    from jaxpar.supervisor import worker_env

    pod1 = _pod_env(jobset, 1)
    assert bootstrap.detect_cluster(pod1) is None  # the agent itself starts no jax
    worker = worker_env(pod1, coordinator="jaxpar-hosts-0-0.jaxpar:41000", bind="[::]:41000",
                        nproc=16, process_id=9, local_rank=1, devices_per_proc=1, run_dir="/runs/x",
                        incarnation=0, faults=[], heartbeat_timeout=60, collective_timeout=60)  # fmt: skip
    assert bootstrap.detect_cluster(worker) == "explicit"
    assert worker[bootstrap.ENV_PROCESS_ID] == "9" and worker["JOB_COMPLETION_INDEX"] == "1"
    assert worker["JAX_LOCAL_DEVICE_IDS"] == "1"  # the second GPU of this pod
    direct = dict(pod1, **{bootstrap.ENV_COORDINATOR: "jaxpar-hosts-0-0.jaxpar:1234",
                           bootstrap.ENV_NUM_PROCESSES: "2"})  # fmt: skip
    assert bootstrap.detect_cluster(direct) == "k8s"


@pytest.mark.slow
def test_indexed_job_pods_initialize_jax_distributed(tmp_path):
    """Two processes with only an Indexed Job pod's variables (JOB_COMPLETION_INDEX) and the
    manifest's JAXPAR_COORDINATOR / JAXPAR_NUM_PROCESSES join one jax.distributed job."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("from jaxpar.worker import bootstrap; bootstrap.configure_devices(); "
            "assert bootstrap.initialize_from_env(); import jax; "
            "print(bootstrap.detect_cluster(), jax.process_index(), jax.process_count(), "
            "jax.device_count())")  # fmt: skip
    procs = []
    for index in (0, 1):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXPAR_", "SLURM_"))}
        env.update({"JOB_COMPLETION_INDEX": str(index), bootstrap.ENV_COORDINATOR: f"127.0.0.1:{port}",
                    bootstrap.ENV_NUM_PROCESSES: "2", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for index, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-2000:]
        assert out.split()[-4:] == ["k8s", str(index), "2", "4"]
