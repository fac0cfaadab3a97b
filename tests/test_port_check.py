"""``up``'s port check (``ops/runtime.check_port_free``): a port a process listens on is refused; a port
held only by the closed connections of a service stopped a moment ago (TIME_WAIT) is free, as it is
for the listeners that will bind it (they bind with SO_REUSEADDR), so ``up`` starts again at once."""

from __future__ import annotations

import socket

import pytest

from rollout_service.ops.runtime import check_port_free


def test_a_listening_port_is_refused_and_a_time_wait_port_is_free():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(RuntimeError, match=f"HTTP port {port} is in use"):
        check_port_free(port, "HTTP", flag="--port")
    client = socket.create_connection(("127.0.0.1", port))
    served, _ = listener.accept()
    served.close()  # the service's side closes first: its end of the connection, on `port`, goes to TIME_WAIT
    client.close()
    listener.close()
    with socket.socket() as plain:  # what the check did before: refused although nothing listens
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    check_port_free(port, "HTTP", flag="--port")
    again = socket.socket()  # and the next service's listener binds it at once
    again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    again.bind(("127.0.0.1", port))
    again.listen()
    again.close()
