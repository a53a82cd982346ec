"""Sockets for tests that play a peer of jaxpar's servers (a fake leader, a stranger)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator


def accepted(server: socket.socket, stop: threading.Event) -> Iterator[socket.socket]:
    """The connections `server` accepts until `stop` is set (checked every 0.2 s)."""
    server.settimeout(0.2)
    while not stop.is_set():
        try:
            sock, _ = server.accept()
        except TimeoutError:
            continue
        yield sock


def slow_loris(port: int, stop: threading.Event, n: int, sources: int, opened: list,
               first: int = 2) -> None:  # fmt: skip
    """n connections from `sources` loopback addresses (127.0.0.`first` on), a byte every 0.2 s
    each; one that is closed is opened again at once."""
    socks: list = [None] * n
    while not stop.is_set():
        for i in range(n):
            try:
                if socks[i] is None:
                    s = socket.socket()
                    s.bind((f"127.0.0.{first + i % sources}", 0))
                    s.settimeout(1)
                    s.connect(("127.0.0.1", port))
                    socks[i] = s
                    opened.append(1)
                socks[i].sendall(b" ")
            except OSError:
                if socks[i] is not None:
                    socks[i].close()
                socks[i] = None
        stop.wait(0.2)
    for s in socks:
        if s is not None:
            s.close()
