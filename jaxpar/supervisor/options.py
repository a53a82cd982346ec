"""`jaxpar launch`'s options, their validation (one line naming the fix) and the console voice."""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import shutil
import socket
import sys
from dataclasses import dataclass, field

TOKEN_ENV = "JAXPAR_LAUNCH_TOKEN"  # the agents' shared secret, if not in --token-file
TOKEN_FILE = "launch-token"  # RUN_DIR/launch-token (0600) when neither is given


@dataclass
class Options:
    command: list[str]
    nproc: int  # workers on this host
    run_dir: str
    devices_per_proc: int = 1
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str = "127.0.0.1:0"  # agents' control channel (nnodes > 1); host for jax too
    # address the leader's control channel and jax's coordinator bind to: None = the
    # coordinator's host exactly (loopback on one node)
    bind_host: str | None = None
    token_file: str | None = None  # the shared secret (else $JAXPAR_LAUNCH_TOKEN / RUN_DIR)
    max_restarts: int = 3
    min_nproc: int = 1  # total over all hosts
    hang_timeout: float | None = None  # None: max(60 s, 10 x median step time)
    startup_timeout: float | None = None  # None: 3 x the measured start-up, 600 s at first
    collective_timeout: float | None = None  # None: derived, always > the hang timeout
    # SIGTERM -> SIGKILL. Short: a jax worker takes SIGTERM as a preemption notice and does not
    # exit, and a survivor blocked in a collective with a dead peer never returns (gloo).
    grace_s: float = 1.0
    # pre-start the next group's workers (imports done) while a group trains: faster restarts
    spares: bool = True
    # build the next incarnation's group ahead (jaxpar/worker/standby.py): single host (replica
    # groups: each host for its own groups), off by default
    standby: bool = False
    preempt_grace_s: float = 120.0  # time for a coordinated preemption save
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 30.0
    crash_loop: int = 3  # the same failure at the same step this many times in a row: give up
    straggler_factor: float = 2.0
    faults: list[str] = field(default_factory=list)
    rendezvous_timeout_s: float = 300.0
    # a connection to the control channel or the group hub must complete the whole handshake
    # within this (not per read): an unauthenticated connection holds a handshake slot no longer
    handshake_timeout_s: float = 5.0
    poll_s: float = 0.1
    # replica groups (jaxpar/supervisor/replicas.py): nproc / groups processes each, data
    # parallel across groups through the leader's group hub; a failed group restarts alone
    groups: int = 1
    min_groups: int = 1  # the smallest quorum that may train a step
    status_every_s: float = 30.0

    @property
    def host(self) -> str:
        return split_address(self.coordinator)[0]

    @property
    def control_port(self) -> int:
        return split_address(self.coordinator)[1]

    @property
    def bind(self) -> str:
        """Where this job's listening sockets bind (never all interfaces unless asked)."""
        if self.bind_host is not None:
            return self.bind_host
        return self.host if self.nnodes > 1 else "127.0.0.1"


def split_address(text: str) -> tuple[str, int]:
    """HOST:PORT or [IPv6]:PORT -> (host, port); ValueError names the expected form."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"--coordinator {text!r} is not HOST:PORT (example: 10.0.0.1:29400)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"--coordinator {text!r}: write an IPv6 address as [ADDR]:PORT")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--coordinator {text!r}: the port must be a number in 0..65535")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str) -> int:
    """A port nobody listens on at `host` now (for jax's coordinator)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def every_interface(host: str) -> bool:
    """Whether binding `host` listens on every interface (0.0.0.0, ::, and the short forms
    such as 0 that the socket calls read as 0.0.0.0)."""
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    try:
        return socket.inet_aton(host) == bytes(4)  # "0", "0.0", "0x0", ...
    except OSError:
        return False


def _check_host(host: str, what: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    labels = host.split(".")
    if (
        not host
        or len(host) > 253
        or not all(lab and len(lab) <= 63 and lab.replace("-", "").isalnum() for lab in labels)
    ):
        raise ValueError(f"{what} {host!r} is neither an IP address nor a host name")


def _seconds(name: str, value: float | None, *, positive: bool = True) -> None:
    if value is None:
        return
    bad = not math.isfinite(value) or value < 0 or (positive and value == 0)
    if bad:
        need = "a finite number > 0" if positive else "a finite number >= 0"
        raise ValueError(f"{name} {value}: must be {need} (seconds)")


def check_options(o: Options) -> None:
    """Refuse values that would crash or silently misbehave later (ValueError, one line)."""
    if not o.command:
        raise ValueError("no worker command: jaxpar launch [options] -- python -m train ...")
    exe = o.command[0]
    if shutil.which(exe) is None:
        where = "is not an executable file" if os.sep in exe else "was not found on PATH"
        raise ValueError(f"worker command {exe!r} {where}; give the program to run after --")
    if o.nproc < 1 or o.devices_per_proc < 1:
        raise ValueError("--nproc and --devices-per-proc must be >= 1")
    host, port = split_address(o.coordinator)
    _check_host(host, "--coordinator host")
    if every_interface(host):
        raise ValueError(
            f"--coordinator {o.coordinator} names every interface, not an address the other "
            f"hosts reach: give this host's address (e.g. 10.0.0.1:{port}), and --host 0.0.0.0 "
            "to listen on every interface"
        )
    if o.nnodes > 1 and port == 0:
        raise ValueError("--coordinator needs a fixed port with --nnodes > 1 (e.g. HOST:29400)")
    if o.bind_host is not None:
        _check_host(o.bind_host.strip("[]"), "--host")
    if not 0 <= o.node_rank < o.nnodes:
        raise ValueError(f"--node-rank {o.node_rank} must be in [0, --nnodes {o.nnodes})")
    if o.min_nproc < 1 or o.min_nproc > o.nproc * o.nnodes:
        raise ValueError(
            f"--min-nproc {o.min_nproc} must be in [1, the {o.nproc * o.nnodes} processes]"
        )
    if o.max_restarts < 0:
        raise ValueError(f"--max-restarts {o.max_restarts} must be >= 0")
    if o.crash_loop < 1:
        raise ValueError(f"--crash-loop {o.crash_loop} must be >= 1")
    _seconds("--hang-timeout", o.hang_timeout)
    _seconds("--startup-timeout", o.startup_timeout)
    _seconds("--collective-timeout", o.collective_timeout)
    _seconds("--grace", o.grace_s, positive=False)
    _seconds("--backoff", o.backoff_base_s, positive=False)
    _seconds("--backoff-cap", o.backoff_cap_s, positive=False)
    if not (math.isfinite(o.straggler_factor) and o.straggler_factor > 1):
        raise ValueError(f"--straggler-factor {o.straggler_factor} must be a finite number > 1")


def announce_binds(o: Options) -> None:
    """Say it when the leader's sockets listen on every interface (only ever with --host)."""
    if o.node_rank == 0 and every_interface(o.bind):
        say(f"--host {o.bind}: the control channel and jax's coordinator listen on every "
            "interface of this host")  # fmt: skip


def say(msg: str) -> None:
    print(f"[jaxpar launch] {msg}", file=sys.stderr, flush=True)


_unwritable: set[str] = set()


def cannot_write(path: str, e: OSError) -> None:
    """The supervisor carries on without a file it cannot write (a full disk, ...); each kind of
    error is said once, not once per write."""
    why = e.strerror or str(e)
    if why not in _unwritable:
        _unwritable.add(why)
        say(f"cannot write {path}: {why}; carrying on without it (free space in "
            f"{os.path.dirname(path)})")  # fmt: skip
