"""Several "hosts" on one Linux machine: network namespaces joined by a bridge.

    with Hosts(2) as hosts:              # namespaces, veth pairs, a bridge, addresses
        p = hosts.popen(1, ["python", "-m", "train", ...])   # runs on host 1, hostname h1

Host i has its own network stack (loopback + one veth with `hosts.addr(i)`), its own hostname
(`hosts.hostname(i)`, a UTS namespace per process) and an /etc/hosts naming every host (bind-
mounted in a private mount namespace), so gloo and jax.distributed resolve a host's name to its
bridge address and never to loopback. Unlike `ip netns exec`, /sys stays the machine's (slurmd
needs its cgroup mounts). The bridge itself has `hosts.gateway`, so a
daemon in the root namespace (slurmctld) reaches every host. Needs root (CAP_NET_ADMIN).

`close()` SIGKILLs every process left in the namespaces (`ip netns pids`), deletes the links,
namespaces and the hosts file, whatever happened.
"""

from __future__ import annotations

import ipaddress
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip()}")
    return proc


def netns_unavailable() -> str | None:
    """Why this machine cannot run network-namespace hosts (None: it can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (CAP_NET_ADMIN); CI runs the tests as root"
    missing = [b for b in ("ip", "nsenter", "unshare") if shutil.which(b) is None]
    if missing:
        return f"{', '.join(missing)} not found: install iproute2 and util-linux"
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    used = _ip("-o", "-4", "addr", "show").stdout
    rng = random.Random(os.getpid() ^ int(time.time()))
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{rng.randrange(64, 250)}.{rng.randrange(1, 250)}.0/24")
        if f" {net.network_address}".rsplit(".", 1)[0] + "." not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test hosts")


class Hosts:
    """`n` network namespaces on one bridge; see the module docstring."""

    def __init__(self, n: int):
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        self.n = n
        self.ns = [f"jp{tag}h{i}" for i in range(n)]
        self.bridge = f"jpb{tag}"
        self.net = _free_subnet()
        hosts = list(self.net.hosts())
        self.addrs = [str(hosts[i]) for i in range(n)]
        self.gateway = str(hosts[-1])
        self.procs: list[subprocess.Popen] = []
        self._veths: list[str] = []
        self.etc = tempfile.mkdtemp(prefix=f"jaxpar-hosts-{tag}-")
        self.hosts_file = os.path.join(self.etc, "hosts")

    def hostname(self, i: int) -> str:
        return f"h{i}"

    def addr(self, i: int) -> str:
        return self.addrs[i]

    def __enter__(self) -> Hosts:
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        names = "".join(f"{a} {self.hostname(i)}\n" for i, a in enumerate(self.addrs))
        for i, ns in enumerate(self.ns):
            _ip("netns", "add", ns)
            inner, outer = f"{ns}v", f"{ns}p"
            self._veths.append(outer)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/{self.net.prefixlen}", "dev", inner)
            _ip("-n", ns, "link", "set", inner, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        with open(self.hosts_file, "w") as f:
            f.write(f"127.0.0.1 localhost\n{names}{self.gateway} gateway\n")

    def wrap(self, i: int, cmd: list[str]) -> list[str]:
        """`cmd` as it runs on host i: in its namespace, under its own hostname."""
        shell = 'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"'
        return ["nsenter", f"--net=/run/netns/{self.ns[i]}", "unshare", "--uts", "--mount",
                "sh", "-c", shell, self.hostname(i), self.hosts_file, *cmd]  # fmt: skip

    def popen(self, i: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start `cmd` on host i (its own session); killed by close() if still running."""
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.wrap(i, cmd), **kwargs)
        self.procs.append(proc)
        return proc

    def pids(self, i: int) -> list[int]:
        """Every process running in host i's namespace."""
        out = _ip("netns", "pids", self.ns[i], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_host(self, i: int) -> list[int]:
        """SIGKILL everything on host i at once (a lost machine); returns the PIDs."""
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def traffic(self, i: int) -> tuple[int, int]:
        """(bytes host i has sent, bytes it has received) so far: its veth's counters as the
        bridge's side of the pair sees them."""
        stats = f"/sys/class/net/{self._veths[i]}/statistics"
        with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:
            return int(rx.read()), int(tx.read())

    def cut(self, i: int) -> None:
        """Cut host i off the network (its link to the bridge down): a partition; its
        processes keep running and its sockets stay open."""
        _ip("link", "set", self._veths[i], "down")

    def heal(self, i: int) -> None:
        """Put host i back on the network after `cut`."""
        _ip("link", "set", self._veths[i], "up")

    def close(self) -> None:
        for i in range(self.n):
            if os.path.exists(os.path.join("/run/netns", self.ns[i])):
                self.kill_host(i)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for v in self._veths:
            _ip("link", "del", v, check=False)
        for ns in self.ns:
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)
        shutil.rmtree(self.etc, ignore_errors=True)
