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
