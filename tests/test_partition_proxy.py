"""PartitionProxy relays both ways, then drops everything without closing."""

import os
import socket
import threading

import pytest

from tf_diffmap.cluster import PartitionProxy


def echo_server():
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(
                target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(1024), b"")],
                daemon=True,
            ).start()

    threading.Thread(target=serve, daemon=True).start()
    return server


@pytest.mark.parametrize("subprocess", [False, True], ids=["threads", "subprocess"])
def test_a_relay_that_drops_keeps_its_connections_open(subprocess):
    server = echo_server()
    with PartitionProxy(f"127.0.0.1:{server.getsockname()[1]}", subprocess=subprocess) as proxy:
        assert (proxy.pid is not None) == subprocess and proxy.pid != os.getpid()
        host, port = proxy.address.rsplit(":", 1)
        client = socket.create_connection((host, int(port)), timeout=5)
        client.sendall(b"ping")
        assert client.recv(16) == b"ping"
        proxy.drop()
        client.sendall(b"lost")
        client.settimeout(0.5)
        try:
            got = client.recv(16)
        except TimeoutError:
            got = None
        assert got is None  # nothing back, and no close (b"") either
        late = socket.create_connection((host, int(port)), timeout=5)  # accepted, not relayed
        late.sendall(b"ping")
        late.settimeout(0.5)
        try:
            assert late.recv(16) is None
        except TimeoutError:
            pass
        client.close()
        late.close()
    server.close()


def test_a_relay_in_a_subprocess_ends_with_its_close():
    server = echo_server()
    proxy = PartitionProxy(f"127.0.0.1:{server.getsockname()[1]}", subprocess=True).start()
    child = proxy._child
    proxy.close()
    assert child.returncode == 0  # it exited on its own when its input closed
    assert proxy.pid is None
    server.close()


def test_a_target_without_a_port_is_refused():
    with pytest.raises(ValueError, match="host:port"):
        PartitionProxy("127.0.0.1")
