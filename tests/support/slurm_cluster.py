"""A real SLURM cluster on one machine: munged, slurmctld and one slurmd per namespace host.

    with Hosts(2) as hosts, SlurmCluster(hosts, tmp) as slurm:
        job = slurm.sbatch(["deploy/slurm/jaxpar.sbatch", "--steps", "8"], env=...)
        slurm.wait(job, lambda info: info["JobState"] == "COMPLETED", timeout=600)

Debian's slurm-wlm and munge (`apt-get install slurm-wlm munge`; `ensure_installed()` does it
when we are root and apt can reach its mirror). Everything lives in one temporary directory: a
munge key, munged's socket, a generated slurm.conf (proctrack/linuxproc, task/none, no cgroups,
no accounting database), the controller's state and each node's spool and log. slurmctld runs in
the root namespace on the bridge address; node i (`n<i>`) is `slurmd -N n<i>` on host i, so a job
spanning both nodes runs its tasks on two network stacks, as on two machines.

Clients (sbatch, srun, scontrol, squeue, scancel) find the cluster through SLURM_CONF.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.netns_hosts import Hosts

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")
CPUS_PER_NODE = 4  # declared (SlurmdParameters=config_overrides): tasks, not cores
# A requeued job may start again only after the step credential lifetime (default 120 s).
CRED_EXPIRE_S = 15


def missing_binaries() -> list[str]:
    return [b for b in (*DAEMONS, "sbatch", "srun", "scontrol", "scancel") if not shutil.which(b)]


def ensure_installed() -> str | None:
    """Install slurm-wlm and munge with apt if they are missing; returns why it could not."""
    if not missing_binaries():
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"SLURM is not installed ({', '.join(missing_binaries())}) and apt needs root"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):  # fmt: skip
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return f"apt cannot install {' '.join(PACKAGES)} (mirror unreachable?): {tail}"
    return None if not missing_binaries() else f"still missing: {missing_binaries()}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """munged + slurmctld + one slurmd per host of `hosts`, configured under `root`."""

    def __init__(self, hosts: Hosts, root: Path, partition: str = "debug"):
        self.hosts, self.root, self.partition = hosts, Path(root), partition
        self.nodes = [hosts.hostname(i) for i in range(hosts.n)]  # node name = hostname
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- set-up ---------------------------------------------------------------------------------

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _write_conf(self) -> None:
        r = self.root
        ctl_port, node_port = _free_port(), _free_port()
        nodes = "\n".join(
            f"NodeName={name} NodeAddr={self.hosts.addr(i)}"
            f" CPUs={CPUS_PER_NODE} RealMemory=1000 State=UNKNOWN"
            for i, name in enumerate(self.nodes)
        )
        self.conf.write_text(f"""\
ClusterName=jaxpartest
SlurmctldHost={socket.gethostname().split(".")[0]}({self.hosts.gateway})
MailProg=/bin/true
SlurmctldPort={ctl_port}
SlurmdPort={node_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/slurmctld.log
SlurmdLogFile={r}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
Waittime=0
MessageTimeout=30
{nodes}
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def start(self) -> None:
        r = self.root
        (r / "munge").mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o711)  # clients reach the socket
        (r / "state").mkdir(exist_ok=True)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        os.chmod(key, 0o400)
        self._write_conf()
        self._daemon(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                      f"--key-file={key}", f"--log-file={r}/munge/munged.log",
                      f"--pid-file={r}/munge/munged.pid", f"--seed-file={r}/munge/seed"],
                     r / "munged.out")  # fmt: skip
        self._wait(lambda: self.munge_socket.exists(), 30, "munged did not create its socket")
        self._daemon(["slurmctld", "-D", "-i", "-f", str(self.conf)], r / "slurmctld.out")
        self._wait(lambda: self.scontrol("ping").returncode == 0 and "UP" in
                   self.scontrol("ping").stdout, 60, "slurmctld did not answer scontrol ping")  # fmt: skip
        for i, name in enumerate(self.nodes):
            (r / f"spool-{name}").mkdir(exist_ok=True)
            cmd = ["slurmd", "-D", "-N", name, "-f", str(self.conf)]
            out = open(r / f"slurmd-{name}.out", "wb")
            self.procs.append(self.hosts.popen(i, cmd, env=self.env, stdout=out,
                                               stderr=subprocess.STDOUT))  # fmt: skip
        self._wait(self._nodes_idle, 90, "the slurmd nodes did not register as idle")

    def _daemon(self, cmd: list[str], out: Path) -> None:
        with open(out, "wb") as f:
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip

    def _nodes_idle(self) -> bool:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        states = dict(zip(out[::2], out[1::2], strict=False))
        return all(states.get(n) == "idle" for n in self.nodes)

    def _wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}:\n{self.logs()}")
            if cond():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} within {timeout}s:\n{self.logs()}")

    def logs(self, tail: int = 15) -> str:
        out = []
        for f in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            lines = f.read_text(errors="replace").splitlines()[-tail:]
            out.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(out)

    def close(self) -> None:
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=15)

    # -- clients --------------------------------------------------------------------------------

    def run(self, cmd: list[str], env: dict | None = None, timeout: float = 60,
            **kwargs) -> subprocess.CompletedProcess:  # fmt: skip
        env = {**self.env, **(env or {}), "SLURM_CONF": str(self.conf)}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                              **kwargs)  # fmt: skip

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return self.run(["scontrol", *args])

    def sbatch(self, args: list[str], env: dict | None = None, cwd=None) -> int:
        """Submit; returns the job id."""
        proc = self.run(["sbatch", "--parsable", *args], env=env, cwd=cwd)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch {args}: {proc.stderr.strip()}\n{self.logs()}")
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, NodeList, ...)."""
        out = self.scontrol("show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED",
             "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"),
             timeout: float = 600) -> dict[str, str]:  # fmt: skip
        """Poll until the job is in one of `states` (default: any end state); returns its info."""
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise AssertionError(
            f"job {job_id} not in {states} after {timeout}s: {info}\n{self.logs()}"
        )
