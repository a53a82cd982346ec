"""bootstrap.wait_for_coordinator: a worker other than process 0 connects to jax.distributed's
coordinator only once its port accepts (a client turned away waits out gRPC's ~1 s backoff)."""

from __future__ import annotations

import socket
import threading
import time

from jaxpar.supervisor.options import free_port
from jaxpar.worker import bootstrap


def test_returns_once_the_port_listens():
    port = free_port("127.0.0.1")
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listening = threading.Event()

    def listen_later():
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()
        listening.set()

    t = threading.Thread(target=listen_later)
    t.start()
    try:
        assert bootstrap.wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=30)
        assert listening.is_set()  # it waited for the listener, and returned once it was up
    finally:
        t.join()
        server.close()


def test_gives_up_after_its_timeout_and_on_a_malformed_address():
    port = free_port("127.0.0.1")  # nothing listens there
    assert not bootstrap.wait_for_coordinator(f"127.0.0.1:{port}", timeout_s=0.2)
    assert not bootstrap.wait_for_coordinator("no-port-here", timeout_s=30)  # at once
