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

A partition is outside every task. `PartitionProxy(..., subprocess=True)`
relays from a process of its own (this file run with the standard library
alone, commanded through its standard input): a relay in the chief's
process would need the chief's interpreter to move a byte, so a TensorFlow
call that holds it while it waits on a task would wait on itself.
"""

from __future__ import annotations

import argparse
import socket
import subprocess as _subprocess
import sys
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
        subprocess: relay from a child process (started by `start()`,
            stopped by `close()`) instead of threads of this one.

    Attributes:
        address: where the proxy listens, `host:port` (with `subprocess=True`,
            once `start()` has returned).

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

    def __init__(
        self, target: str, host: str = "127.0.0.1", port: int = 0, subprocess: bool = False
    ):
        target_host, sep, target_port = target.rpartition(":")
        if not sep or not target_port.isdigit():
            raise ValueError(f"PartitionProxy needs its target as host:port, not {target!r}.")
        self._target = (target_host, int(target_port))
        self._dropping = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._thread: threading.Thread | None = None
        self._child: _subprocess.Popen | None = None
        self._listener: socket.socket | None = None
        if subprocess:
            self._spec = (target, host, port)
            self.address = None
        else:
            self._listener = socket.create_server((host, port))
            self._listener.settimeout(0.1)
            self.address = f"{host}:{self._listener.getsockname()[1]}"

    def start(self) -> PartitionProxy:
        if self._listener is None:
            return self._start_child()
        self._thread = threading.Thread(target=self._accept, name="partition-proxy", daemon=True)
        self._thread.start()
        return self

    def drop(self) -> None:
        """From now on nothing crosses, and no connection is closed."""
        if self._child is not None:
            self._command("drop")
        self._dropping.set()

    def dropping(self) -> bool:
        return self._dropping.is_set()

    @property
    def pid(self) -> int | None:
        """The relaying child's process id (None: the relay is in this process)."""
        return None if self._child is None else self._child.pid

    def close(self) -> None:
        """Closes every socket of the proxy and ends its threads (or its child)."""
        self._closed.set()
        if self._child is not None:
            self._stop_child()
            return
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

    # -- a relay in a child process -------------------------------------------

    def _start_child(self) -> PartitionProxy:
        target, host, port = self._spec
        self._child = _subprocess.Popen(
            [sys.executable, "-I", __file__, target, "--host", host, "--port", str(port)],
            stdin=_subprocess.PIPE,
            stdout=_subprocess.PIPE,
            text=True,
        )
        line = self._child.stdout.readline().strip()
        if not line.startswith("listening "):
            self._stop_child()
            raise RuntimeError(
                f"The partition relay to {target} did not start (it said {line!r}): "
                f"is {host}:{port} free?"
            )
        self.address = line.split(" ", 1)[1]
        return self

    def _command(self, command: str) -> None:
        self._child.stdin.write(command + "\n")
        self._child.stdin.flush()
        answer = self._child.stdout.readline().strip()
        if answer != command:
            raise RuntimeError(f"The partition relay answered {answer!r} to {command!r}.")

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        try:
            child.stdin.close()  # the child closes its sockets and exits
        except OSError:
            pass
        try:
            child.wait(10)
        except _subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()

    # -- the relay ---------------------------------------------------------------

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


def main(argv=None) -> None:
    """Runs a relay until its standard input closes; the line `drop` drops.

    It prints `listening HOST:PORT` once it listens, and echoes each command
    once it has taken effect.
    """
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("target", help="the task's real address, host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = PartitionProxy(args.target, host=args.host, port=args.port).start()
    print(f"listening {proxy.address}", flush=True)
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "drop":
                proxy.drop()
            print(command, flush=True)
    finally:
        proxy.close()


if __name__ == "__main__":
    main()
