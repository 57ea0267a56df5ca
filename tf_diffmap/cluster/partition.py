"""A network partition on one machine: a TCP relay that can go silent.

`PartitionProxy` listens on a free port of 127.0.0.1 and relays each
connection to a task's real address, both ways. Give the chief the proxy's
address for that task (`LocalCluster.resolver(through={...})`) and every
byte between the chief (and the tasks the chief introduces it to) and the
task crosses it. `drop()` then makes it a partition that keeps its
connections open: it reads what either side sends and throws it away, and
it accepts new connections without relaying them; no connection is closed
or reset, so TCP reports nothing, as with a cable cut between two switches
or a firewall that drops packets.
"""

from __future__ import annotations

import selectors
import socket
import threading

__all__ = ["PartitionProxy"]


class PartitionProxy:
    """A relay to `target` (`host:port`) that `drop()` turns into a partition.

    A context manager: entering starts it, leaving closes every socket.

    Args:
        target: the real address of the task, `host:port`.
        host: where the proxy listens.

    Attributes:
        address: where the proxy listens, `host:port`.
    """

    def __init__(self, target: str, host: str = "127.0.0.1"):
        target_host, _, port = target.rpartition(":")
        self._target = (target_host, int(port))
        self._listener = socket.create_server((host, 0))
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._dropping = threading.Event()
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._peers: dict[socket.socket, socket.socket | None] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> PartitionProxy:
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="partition-proxy", daemon=True)
        self._thread.start()
        return self

    def drop(self) -> None:
        """From now on nothing crosses, and no connection is closed."""
        self._dropping.set()

    def dropping(self) -> bool:
        return self._dropping.is_set()

    def close(self) -> None:
        """Closes every socket of the proxy and ends its thread."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(5)

    def __enter__(self) -> PartitionProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._selector.select(timeout=0.1):
                    sock = key.fileobj
                    if sock is self._listener:
                        self._accept()
                    else:
                        self._relay(sock)
        finally:
            for sock in [self._listener, *self._peers]:
                try:
                    self._selector.unregister(sock)
                except (KeyError, ValueError):
                    pass
                sock.close()
            self._selector.close()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._dropping.is_set():
            # Accepted and never relayed: the handshake of whatever speaks
            # on it waits for ever.
            self._peers[client] = None
            self._selector.register(client, selectors.EVENT_READ)
            return
        try:
            upstream = socket.create_connection(self._target, timeout=5)
        except OSError:
            client.close()
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._selector.register(sock, selectors.EVENT_READ)
        self._peers[client] = upstream
        self._peers[upstream] = client

    def _relay(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            if self._dropping.is_set():
                self._forget(sock, alone=True)  # Nothing crosses, not even a close.
            else:
                self._forget(sock)
            return
        other = self._peers.get(sock)
        if self._dropping.is_set() or other is None:
            return  # Read and thrown away: the sender sees its bytes taken.
        try:
            other.setblocking(True)
            other.sendall(data)
            other.setblocking(False)
        except OSError:
            self._forget(sock)

    def _forget(self, sock: socket.socket, alone: bool = False) -> None:
        other = None if alone else self._peers.pop(sock, None)
        if alone:
            self._peers.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self._peers.pop(s, None)
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
