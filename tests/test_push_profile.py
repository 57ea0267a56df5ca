"""The push profile's readers: gRPC calls off the wire, kernels off a trace.

`benchmarks.wire` reads HTTP/2 frames and HPACK headers as they pass a
relay; these tests give it frames written by hand, as gRPC writes them
(a path sent once as a literal the decoder adds to its table, then by its
index; a message split over DATA frames), and run a `WireTap` between two
sockets of this process. `benchmarks.traces` is checked on event names as
TensorFlow's profiler writes them and on a profile it writes here.
"""

import json
import os
import socket
import threading

import pytest

from benchmarks import push_profile, traces
from benchmarks.wire import PREFACE, GrpcReader, WireTap

PATH = "/tensorflow.WorkerService/RecvTensor"


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload
    )


def _literal_path(path: str) -> bytes:
    """`:path` (static index 4) as a literal with incremental indexing."""
    return bytes([0x40 | 4, len(path)]) + path.encode()


def _message(body: bytes) -> bytes:
    return b"\x00" + len(body).to_bytes(4, "big") + body


def _request_stream() -> bytes:
    """Two calls of one method: the first names it, the second indexes it
    (the dynamic table's first entry, index 62); the second's message comes
    in two DATA frames."""
    first = _frame(0x1, 0x4, 1, _literal_path(PATH) + bytes([0x80 | 2]))  # + :method POST
    second = _frame(0x1, 0x4, 3, bytes([0x80 | 62]))
    body = _message(b"x" * 100)
    return (
        PREFACE
        + first
        + _frame(0x0, 0x1, 1, _message(b"abc"))
        + second
        + _frame(0x0, 0x0, 3, body[:40])
        + _frame(0x0, 0x1, 3, body[40:])
    )


def _response_stream() -> bytes:
    trailers = bytes([0x40, 11]) + b"grpc-status" + bytes([1]) + b"0"
    return (
        _frame(0x1, 0x4, 1, bytes([0x88]))  # :status 200
        + _frame(0x0, 0x0, 1, _message(b"r" * 10))
        + _frame(0x1, 0x5, 1, trailers)
        + _frame(0x1, 0x4, 3, bytes([0x88]))
        + _frame(0x0, 0x0, 3, _message(b"s" * 20))
        + _frame(0x1, 0x5, 3, trailers)
    )


def test_requests_are_named_by_their_path_literal_or_indexed():
    seen = []
    reader = GrpcReader(True, lambda *event: seen.append(event))
    data = _request_stream()
    for at in range(0, len(data), 7):  # in pieces, as a socket gives them
        reader.feed(data[at : at + 7])
    assert reader.paths == {1: PATH, 3: PATH}
    assert seen == [(1, "call", 0), (1, "message", 8), (3, "call", 0), (3, "message", 105)]


def test_responses_count_messages_and_trailers():
    seen = []
    reader = GrpcReader(False, lambda *event: seen.append(event))
    reader.feed(_response_stream())
    assert seen == [
        (1, "message", 15),
        (1, "done", 0),
        (3, "message", 25),
        (3, "done", 0),
    ]


def test_a_connection_without_the_preface_is_refused():
    reader = GrpcReader(True, lambda *event: None)
    with pytest.raises(ValueError, match="preface"):
        reader.feed(b"GET / HTTP/1.1\r\n\r\nxxxxxxxx")


def test_the_tap_counts_calls_by_caller_task_and_method():
    """A `WireTap` between a client and a server of this process counts two
    calls of one method, their messages and bytes, with this process as caller."""
    server = socket.create_server(("127.0.0.1", 0))
    address = socket.create_server(("127.0.0.1", 0))  # a free address for the tap
    public = address.getsockname()[1]
    address.close()
    request, response = _request_stream(), _response_stream()

    def serve():
        connection, _ = server.accept()
        received = b""
        while len(received) < len(request):
            received += connection.recv(1 << 16)
        connection.sendall(response)
        connection.recv(1)  # until the client closes
        connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with WireTap([(f"127.0.0.1:{public}", server.getsockname()[1], "ps 0")]) as tap:
        client = socket.create_connection(("127.0.0.1", public))
        client.sendall(request)
        received = b""
        while len(received) < len(response):
            received += client.recv(1 << 16)
        assert received == response
        client.close()
        thread.join(timeout=10)
        rows = {row["method"]: row for row in tap.report()}
    server.close()
    calls, wire = rows["RecvTensor"], rows["(bytes)"]
    assert calls["caller_pid"] == os.getpid() and calls["task"] == "ps 0"
    assert (calls["calls"], calls["requests"], calls["responses"]) == (2, 2, 2)
    assert (calls["request_bytes"], calls["response_bytes"]) == (113, 40)
    assert calls["call_seconds"] >= 0
    assert (calls["small_requests"], calls["small_responses"]) == (2, 2)
    assert (wire["bytes_sent"], wire["bytes_received"]) == (len(request), len(response))


def test_kernel_events_are_told_from_the_runtime_s_own():
    assert traces.op_type("dense/MatMul:MatMul") == "MatMul"
    assert traces.op_type("while/body/_1/x/_12:_Send") == "_Send"
    for name in (
        "ExecutorState::Process",
        "EagerService:Enqueue",
        "EagerLocalExecute: ReadVariableOp",
        "Iterator::Root::Prefetch",
    ):
        assert traces.op_type(name) is None, name


def test_a_profile_is_read_back_with_its_kernels(tmp_path):
    import tensorflow as tf

    x = tf.ones((8, 8))

    @tf.function
    def step(x):
        return tf.matmul(x, x)

    step(x)
    start, end = traces.trace_tasks(lambda: step(x), tmp_path, {}, seconds=1)
    events = traces.read_events(tmp_path)
    assert list(events) == ["chief"] and start < end
    # The kernel ran within the traced call, on the host's clock.
    summary = traces.op_summary(events["chief"], start, end, steps=1)
    # With oneDNN, the kernel is `_MklMatMul`.
    assert sum(v["ops"] for k, v in summary["by_type"].items() if "MatMul" in k) >= 1


def test_sends_are_counted_per_step_by_their_short_names():
    from tf_diffmap._tf_internal import ProfileEvent

    loop = "while/body/_1/while/cond/StatefulPartitionedCall/"
    events = [
        ProfileEvent(
            "/host:CPU", "tf_Compute", f"{loop}tf_diffmap_packed/concat/_4:_Send", 10, 1.0
        ),
        ProfileEvent(
            "/host:CPU", "tf_Compute", f"{loop}tf_diffmap_packed/concat/_9:_Send", 20, 1.0
        ),
        ProfileEvent("/host:CPU", "tf_Compute", f"{loop}LessEqual/_7:_Send", 30, 1.0),
        ProfileEvent("/host:CPU", "tf_Compute", f"{loop}dense/MatMul:MatMul", 30, 1.0),
        ProfileEvent("/host:CPU", "tf_Compute", f"{loop}Late/_8:_Send", 99, 1.0),
    ]
    assert traces.sends(events, 0, 50, steps=2) == {
        "tf_diffmap_packed/concat": 1.0,
        "LessEqual": 0.5,
    }


def test_the_tables_print_a_row_per_contender_and_per_call():
    calls = [
        {
            "caller": "worker 0",
            "task": "ps 0",
            "method": "RecvTensor",
            "calls": 6.0,
            "request_bytes": 1024.0,
            "response_bytes": 2048.0,
            "call_seconds": 0.012,
            "small_responses": 4.0,
        },
        {
            "caller": "worker 0",
            "task": "ps 0",
            "method": "(bytes)",
            "calls": 0.0,
            "bytes_sent": 2048.0,
            "bytes_received": 4096.0,
        },
    ]
    result = {
        "label": "a contender",
        "step_ms": 10.0,
        "examples_per_second": 12800.0,
        "cpu_ms": {"ps 0": 4.25, "chief": 3.0},
        "pushes": [2.0, 0.5],
        "calls": calls,
        "profile": {
            "sends": {"ps 0": {"Reshape_1": 3.0, "LessEqual": 1.0}},
            "tasks": {
                "ps 0": {"ops": 40.0, "op_ms": 1.5, "by_type": {"MatMul": {"ops": 2.0, "ms": 1.0}}}
            },
        },
    }
    (summary,) = push_profile.summary_rows([result])
    assert summary["remote calls"] == "6.0" and summary["by method"] == "RecvTensor 6.0"
    # RecvTensor is a pull: worker 0's calls bring the ps's tensors back.
    assert (summary["KB ps -> workers"], summary["KB workers -> ps"]) == ("2.0", "1.0")
    assert summary["responses < 1 KB"] == "4.0"
    assert summary["ps kernels"] == "40" and summary["ps top kernels"] == "MatMul 2"
    (detail,) = push_profile.detail_rows([result])
    assert detail["caller -> task"] == "worker 0 -> ps 0" and detail["ms/call"] == "2.00"
    (sent,) = push_profile.send_rows([{**result, "contender": "cluster"}])
    assert sent["values sent"] == "4.0" and sent["most sent"] == "Reshape_1 3.0, LessEqual 1.0"
    table = push_profile.markdown([summary])
    assert summary["CPU ms/batch by process"] == "chief 3.0, ps 0 4.2"
    row = "| a contender | 10.0 | 12,800 | chief 3.0, ps 0 4.2 | 2.0 (0.5) | 6.0 |"
    assert table.splitlines()[2].startswith(row)


def test_a_saved_run_is_printed_again_and_a_missing_one_is_named(tmp_path):
    result = {
        "contender": "parameter_server",
        "label": "ParameterServerStrategy (tf-keras)",
        "step_ms": 20.0,
        "examples_per_second": 6400.0,
        "pushes": None,
        "calls": [],
        "profile": {"tasks": {}, "sends": {}, "timeline": {}, "span_ms": 1.0},
    }
    (tmp_path / "parameter_server.json").write_text(json.dumps(result))
    tapped = dict(result, step_ms=30.0, calls=[{"caller": "chief", "task": "ps 0"}])
    (tmp_path / "parameter_server_tap.json").write_text(json.dumps(tapped))
    saved = push_profile._saved("parameter_server", tmp_path)
    assert saved["calls"] == tapped["calls"] and saved["tapped_step_ms"] == 30.0
    with pytest.raises(FileNotFoundError, match="cluster.json is missing"):
        push_profile._saved("cluster", tmp_path)
