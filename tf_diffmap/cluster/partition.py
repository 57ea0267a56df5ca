"""A network partition on one machine: a TCP relay that can go silent.

`PartitionProxy` listens on a free port of 127.0.0.1 and relays each
connection to a task's real address, both ways. Let the proxy listen at
the task's address in the cluster and the task at another port
(`LocalCluster(listen_ports={...})`, `python -m tf_diffmap.cluster
--port`), and every byte any other task sends it crosses the proxy.
`drop()` then makes it a partition that keeps its connections open: it
reads what either side sends and throws it away, and it accepts new
connections without relaying them; no connection is closed or reset, so
TCP reports nothing, as with a cable cut between two switches or a
firewall that drops packets.
"""

from __future__ import annotations

import socket
import threading

__all__ = ["PartitionProxy"]


class PartitionProxy:
    """A relay to `target` (`host:port`) that `drop()` turns into a partition.

    A context manager: entering starts it, leaving closes every socket. One
    thread accepts, and two threads relay each connection (one per way), so
    that a side that waits to send never holds up the other way.

    Args:
        target: the real address of the task, `host:port`.
        host: where the proxy listens.
        port: the port it listens on; by default a free one.

    Attributes:
        address: where the proxy listens, `host:port`.

    Examples:
        >>> import socket
        >>> from tf_diffmap.cluster import PartitionProxy
        >>> task = socket.create_server(("127.0.0.1", 0))  # stands in for a task
        >>> with PartitionProxy(f"127.0.0.1:{task.getsockname()[1]}") as proxy:
        ...     proxy.drop()
        ...     proxy.dropping()
        True
        >>> task.close()
    """

    def __init__(self, target: str, host: str = "127.0.0.1", port: int = 0):
        target_host, _, target_port = target.rpartition(":")
        self._target = (target_host, int(target_port))
        self._listener = socket.create_server((host, port))
        self._listener.settimeout(0.1)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._dropping = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._thread: threading.Thread | None = None

    def start(self) -> PartitionProxy:
        self._thread = threading.Thread(target=self._accept, name="partition-proxy", daemon=True)
        self._thread.start()
        return self

    def drop(self) -> None:
        """From now on nothing crosses, and no connection is closed."""
        self._dropping.set()

    def dropping(self) -> bool:
        return self._dropping.is_set()

    def close(self) -> None:
        """Closes every socket of the proxy and ends its threads."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self._sockets.clear()

    def __enter__(self) -> PartitionProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    client, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    return
                with self._lock:
                    self._sockets.append(client)
                if self._dropping.is_set():
                    # Accepted and never relayed: a handshake on it waits for ever.
                    self._start(self._sink, client)
                    continue
                try:
                    upstream = socket.create_connection(self._target, timeout=5)
                except OSError:
                    client.close()
                    continue
                upstream.settimeout(None)
                with self._lock:
                    self._sockets.append(upstream)
                for sock in (client, upstream):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._start(self._pipe, client, upstream)
                self._start(self._pipe, upstream, client)
        finally:
            self._listener.close()

    def _start(self, target, *args) -> None:
        threading.Thread(target=target, args=args, name="partition-relay", daemon=True).start()

    def _sink(self, source: socket.socket) -> None:
        """Reads and throws away until the proxy closes."""
        try:
            while source.recv(1 << 16):
                pass
        except OSError:
            pass

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Relays one way; once dropping, reads and throws away (the sender
        sees its bytes taken), and passes on no close either."""
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                if not self._dropping.is_set():
                    sink.sendall(data)
        except OSError:
            return
        if not self._dropping.is_set():
            try:
                sink.shutdown(socket.SHUT_WR)
            except OSError:
                pass
