"""What crosses the wire between a cluster's tasks: gRPC calls and bytes.

`WireTap` puts a relay at the address of each task it is given (the task
itself listening on another port: `LocalCluster(listen_ports=...)` or
`LocalServers(listen_ports=...)`), in a child process of its own: relay
threads in the chief's process would wait for the GIL that TensorFlow holds
while it connects to the cluster, and the chief would wait for them. The
relay reads each connection's HTTP/2 frames as they pass, and counts, per
caller process, task called and gRPC method: the calls (streams opened),
the request and response messages and their bytes, the seconds from a
call's request headers to its response's trailers, and the bytes each way
of the connections (headers and HTTP/2 framing included).

A method's name is read from the request headers. gRPC sends a path once
per connection as a plain literal that the HPACK decoder adds to its table,
and then by its index; `_HeaderTable` keeps enough of HPACK (RFC 7541) to
follow those indices. A name it cannot read (a Huffman-coded path, which
gRPC does not send here) is counted as `"?"`, never dropped.

    python -m benchmarks.wire '[["127.0.0.1:5000", 5001, "ps0"], ...]'

reads commands on standard input, one a line: `reset` zeroes the counts,
`report` prints them as one JSON line; the end of input stops it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["FIELDS", "GrpcReader", "WireTap"]

ROOT = Path(__file__).resolve().parent.parent
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, CONTINUATION = 0x0, 0x1, 0x9
END_STREAM, END_HEADERS, PADDED, PRIORITY = 0x1, 0x4, 0x8, 0x20
# The names of HPACK's static table (RFC 7541, appendix A) that a gRPC
# request can refer to; only `:path` is read, the others keep the count.
STATIC_TABLE_SIZE = 61
PATH_INDEX = 4  # (":path", "/")
FIELDS = (
    "calls",
    "requests",
    "responses",
    "request_bytes",
    "response_bytes",
    "bytes_sent",
    "bytes_received",
    "call_seconds",
    "small_requests",
    "small_responses",
)
# A message under this size carries no tensor of any size (a scalar, a
# request for a tensor): `small_*` count them apart.
SMALL_BYTES = 1024


def _process_of(port: int) -> int | None:
    """The process whose local TCP port of 127.0.0.1 `port` is (the caller)."""
    import psutil

    for connection in psutil.net_connections(kind="tcp"):
        if connection.laddr and connection.laddr.port == port and connection.pid:
            return connection.pid
    return None


class _HeaderTable:
    """HPACK's dynamic table, kept only as far as `:path` needs.

    Entries are `(name, value)` with `None` for a string that was
    Huffman-coded (not decoded here); the table's size counts such a string
    at its coded length, which can only keep more entries than the sender
    does (a Huffman code is never longer than 8/5 of its text), so a path
    read through an evicted index comes out as `"?"`, not as another path.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[str | None, str | None]] = []
        self.max_size = 4096

    def _size(self) -> int:
        return sum(32 + len(n or "") + len(v or "") for n, v in self.entries)

    def add(self, name: str | None, value: str | None) -> None:
        self.entries.insert(0, (name, value))
        while self.entries and self._size() > self.max_size:
            self.entries.pop()

    def lookup(self, index: int) -> tuple[str | None, str | None]:
        if 0 < index <= STATIC_TABLE_SIZE:
            return (":path", "/") if index == PATH_INDEX else ("static", None)
        position = index - STATIC_TABLE_SIZE - 1
        if 0 <= position < len(self.entries):
            return self.entries[position]
        return (None, None)


def _integer(block: bytes, at: int, prefix: int) -> tuple[int, int]:
    """An HPACK integer of `prefix` bits at `block[at]`; `(value, next)`."""
    mask = (1 << prefix) - 1
    value = block[at] & mask
    at += 1
    if value < mask:
        return value, at
    shift = 0
    while True:
        byte = block[at]
        at += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _string(block: bytes, at: int) -> tuple[str | None, int]:
    """An HPACK string literal; `None` if it is Huffman-coded."""
    huffman = block[at] & 0x80
    length, at = _integer(block, at, 7)
    raw = block[at : at + length]
    return (None if huffman else raw.decode("latin-1")), at + length


def request_path(block: bytes, table: _HeaderTable) -> str:
    """The `:path` of one request's header block (`"?"` if unreadable),
    the dynamic `table` brought up to date as the sender's is."""
    path = "?"
    at = 0
    while at < len(block):
        byte = block[at]
        if byte & 0x80:  # indexed field
            index, at = _integer(block, at, 7)
            name, value = table.lookup(index)
        elif (byte & 0xE0) == 0x20:  # dynamic table size update
            table.max_size, at = _integer(block, at, 5)
            while table.entries and table._size() > table.max_size:
                table.entries.pop()
            continue
        else:
            indexing = (byte & 0xC0) == 0x40
            index, at = _integer(block, at, 6 if indexing else 4)
            if index:
                name = table.lookup(index)[0]
            else:
                name, at = _string(block, at)
            value, at = _string(block, at)
            if indexing:
                table.add(name, value)
        if name == ":path" and value is not None and value != "/":
            path = value
    return path


class GrpcReader:
    """Reads one direction of one HTTP/2 connection, frame by frame.

    Args:
        requests: the client's side (the preface, request headers).
        count: `(stream_id, kind, size)` for each `"call"` (a new stream's
            headers), each `"message"` (a gRPC message, its 5-byte prefix
            included) and each `"done"` (a response's trailers).
    """

    def __init__(self, requests: bool, count) -> None:
        self._buffer = bytearray()
        self._preface = requests
        self._requests = requests
        self._count = count
        self._table = _HeaderTable()
        self._headers: tuple[int, bytearray] | None = None
        self._ends = False
        self._messages: dict[int, tuple[bytes, int, int]] = {}
        self.paths: dict[int, str] = {}

    def feed(self, data: bytes) -> None:
        self._buffer += data
        if self._preface:
            if len(self._buffer) < len(PREFACE):
                return
            if not self._buffer.startswith(PREFACE):
                raise ValueError("The connection does not start with HTTP/2's preface.")
            del self._buffer[: len(PREFACE)]
            self._preface = False
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                return
            kind, flags = self._buffer[3], self._buffer[4]
            stream = int.from_bytes(self._buffer[5:9], "big") & 0x7FFFFFFF
            payload = memoryview(bytes(self._buffer[9 : 9 + length]))
            del self._buffer[: 9 + length]
            self._frame(kind, flags, stream, payload)

    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if kind in (DATA, HEADERS) and flags & PADDED:
            payload = payload[1 : len(payload) - payload[0]]
        if kind == HEADERS:
            if flags & PRIORITY:
                payload = payload[5:]
            self._headers = (stream, bytearray(payload))
            self._ends = bool(flags & END_STREAM)
        elif kind == CONTINUATION and self._headers is not None:
            self._headers[1].extend(payload)
        elif kind == DATA:
            self._data(stream, payload)
            return
        else:
            return
        if flags & END_HEADERS and self._headers is not None:
            stream, block = self._headers
            self._headers = None
            if self._requests:
                self.paths[stream] = request_path(bytes(block), self._table)
                self._count(stream, "call", 0)
            else:  # response headers and trailers: kept in step, not read
                request_path(bytes(block), self._table)
                if self._ends:
                    self._count(stream, "done", 0)

    def _data(self, stream: int, payload: memoryview) -> None:
        # Each stream's messages as a 5-byte prefix (its size) and a body,
        # counted as they end, not copied.
        prefix, remaining, size = self._messages.get(stream, (b"", 0, 0))
        at = 0
        while at < len(payload):
            if remaining:
                take = min(remaining, len(payload) - at)
                remaining -= take
                at += take
                if not remaining:
                    self._count(stream, "message", size)
                continue
            take = bytes(payload[at : at + 5 - len(prefix)])
            prefix += take
            at += len(take)
            if len(prefix) == 5:
                remaining = int.from_bytes(prefix[1:5], "big")
                size, prefix = 5 + remaining, b""
                if not remaining:
                    self._count(stream, "message", size)
        self._messages[stream] = (prefix, remaining, size)


class _Relay:
    """The child process: a relay per task, the counts, the commands."""

    def __init__(self, tasks: list[tuple[str, int, str]]) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple, dict[str, int]] = {}
        self._tasks = tasks

    def _add(self, key: tuple, field: str, amount: int) -> None:
        with self._lock:
            self._counts.setdefault(key, dict.fromkeys(FIELDS, 0))[field] += amount

    def serve(self) -> None:
        for address, port, name in self._tasks:
            host, _, listen = address.rpartition(":")
            server = socket.create_server((host, int(listen)))
            threading.Thread(
                target=self._accept, args=(server, host, port, name), daemon=True
            ).start()
        print(json.dumps({"relaying": [name for _, _, name in self._tasks]}), flush=True)
        for line in sys.stdin:
            command = line.strip()
            if command == "reset":
                with self._lock:
                    self._counts.clear()
                print(json.dumps({"reset": True}), flush=True)
            elif command == "report":
                with self._lock:
                    rows = [
                        {"caller_pid": k[0], "task": k[1], "method": k[2], **v}
                        for k, v in self._counts.items()
                    ]
                print(json.dumps({"report": rows}), flush=True)
            else:
                print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)

    def _accept(self, server: socket.socket, host: str, port: int, name: str) -> None:
        while True:
            client, (_, caller_port) = server.accept()
            self._relay(client, _process_of(caller_port), (host, port), name)

    def _relay(self, client: socket.socket, caller: int | None, target_address, name: str) -> None:
        """Relays one connection from process `caller` to task `name`."""
        target = socket.create_connection(target_address)
        # Without it, Nagle's algorithm and delayed acknowledgements hold
        # small messages back by tens of milliseconds.
        for end in (client, target):
            end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started: dict[int, float] = {}

        def key(stream: int) -> tuple:
            return (caller, name, requests.paths.get(stream, "?").rpartition("/")[2])

        def count_request(stream, kind, size):
            if kind == "call":
                started[stream] = time.perf_counter()
            self._add(key(stream), "calls" if kind == "call" else "requests", 1)
            self._add(key(stream), "request_bytes", size)
            if kind == "message" and size < SMALL_BYTES:
                self._add(key(stream), "small_requests", 1)

        def count_response(stream, kind, size):
            if kind == "done" and stream in started:
                self._add(key(stream), "call_seconds", time.perf_counter() - started.pop(stream))
            elif kind == "message":
                self._add(key(stream), "responses", 1)
                self._add(key(stream), "response_bytes", size)
                if size < SMALL_BYTES:
                    self._add(key(stream), "small_responses", 1)

        requests = GrpcReader(True, count_request)
        responses = GrpcReader(False, count_response)
        for source, sink, reader, field in (
            (client, target, requests, "bytes_sent"),
            (target, client, responses, "bytes_received"),
        ):
            threading.Thread(
                target=self._pipe,
                args=(source, sink, reader, (caller, name), field),
                daemon=True,
            ).start()

    def _pipe(self, source, sink, reader: GrpcReader, key, field: str) -> None:
        # Bytes not yet given a method are counted under the connection's
        # last stream's method when the frame is read; whole frames are
        # what `GrpcReader` counts, so bytes go by connection here.
        while True:
            try:
                data = source.recv(1 << 16)
            except OSError:
                break
            if not data:
                break
            reader.feed(data)
            self._add((*key, "(bytes)"), field, len(data))
            try:
                sink.sendall(data)
            except OSError:
                break
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class WireTap:
    """A relay at each task's address, in a child process, counting calls.

    Args:
        tasks: `(address, port, name)` per task: the address the others
            reach it at, the port it really listens on, and its name.

    Example:
        Used by `benchmarks.push_profile` around a localhost cluster
        started with `listen_ports`:

        >>> tap = WireTap([("127.0.0.1:5000", 5001, "ps0")])  # doctest: +SKIP
    """

    def __init__(self, tasks: list[tuple[str, int, str]]) -> None:
        self._tasks = [list(t) for t in tasks]
        self._process: subprocess.Popen | None = None

    def start(self) -> WireTap:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.wire", json.dumps(self._tasks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        self._answer("relaying")
        return self

    def _answer(self, key: str) -> Any:
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"The wire tap (pid {self._process.pid}) exited.")
        answer = json.loads(line)
        if key not in answer:
            raise RuntimeError(f"The wire tap answered {answer!r}, expected {key!r}.")
        return answer[key]

    def _command(self, command: str, key: str) -> Any:
        self._process.stdin.write(command + "\n")
        self._process.stdin.flush()
        return self._answer(key)

    def reset(self) -> None:
        self._command("reset", "reset")

    def report(self) -> list[dict[str, Any]]:
        """The counts since the last `reset`: one row per caller port, task
        and method (`"(bytes)"`: the connection's bytes each way)."""
        return self._command("report", "report")

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def stop(self) -> None:
        if self._process is not None:
            process, self._process = self._process, None
            process.stdin.close()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self) -> WireTap:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    _Relay([tuple(t) for t in json.loads(sys.argv[1])]).serve()
