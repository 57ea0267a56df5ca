"""The chief's membership endpoint, without a cluster: its requests, replies
and slot states (tests/test_membership_cluster.py joins real workers)."""

import socket
import time
import types

import pytest

from tf_diffmap.cluster.membership import Membership, SlotState, join_command, request

DEVICES = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(3)]


@pytest.fixture
def membership():
    runtime = types.SimpleNamespace(
        replica_devices=DEVICES,
        record=types.SimpleNamespace(lost=set),
        training=lambda: False,
    )
    cluster = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"], "ps": ["127.0.0.1:2000"]}
    m = Membership(
        runtime, {0: "127.0.0.1:1000", 1: "127.0.0.1:1001"}, cluster, port=0, join_timeout=0.5
    )
    yield m
    m.stop()


def ask(m: Membership, message: dict) -> dict:
    return request(f"127.0.0.1:{m.port}", message, timeout=10)


def test_a_worker_is_given_the_free_slot_and_the_cluster(membership):
    assert membership.states() == {0: "member", 1: "member", 2: "empty"}
    reply = ask(membership, {"join": {"address": "127.0.0.1:1002"}})
    assert reply["index"] == 2
    assert reply["cluster"]["worker"] == {
        "0": "127.0.0.1:1000",
        "1": "127.0.0.1:1001",
        "2": "127.0.0.1:1002",
    }
    assert reply["cluster"]["ps"] == {"0": "127.0.0.1:2000"}
    assert membership.states()[2] == "expected"
    # Full now: another is refused with the way to grow further.
    full = ask(membership, {"join": {"address": "127.0.0.1:1003"}})
    assert "max_workers" in full["error"]
    # The same worker asking again is told its slot.
    assert ask(membership, {"join": {"address": "127.0.0.1:1002"}})["already"] is True
    status = ask(membership, {"status": {}})["slots"]
    assert status["2"] == {"state": "expected", "address": "127.0.0.1:1002"}


def test_a_first_worker_holds_its_slot_and_a_held_slot_is_refused(membership):
    reply = ask(membership, {"join": {"address": "127.0.0.1:1001", "index": 1}})
    assert reply["index"] == 1 and reply["already"] is True
    refused = ask(membership, {"join": {"address": "127.0.0.1:1009", "index": 0}})
    assert "held by 127.0.0.1:1000" in refused["error"]
    beyond = ask(membership, {"join": {"address": "127.0.0.1:1009", "index": 7}})
    assert "beyond the slots" in beyond["error"]


def test_a_worker_that_does_not_serve_frees_its_slot(membership):
    with socket.socket() as probe:  # a port nobody serves at
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    assert ask(membership, {"join": {"address": address}})["index"] == 2
    deadline = time.monotonic() + 30
    while membership.states()[2] != "empty" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert membership.states()[2] == "empty"
    assert membership.slots[2].address is None


def test_an_expected_worker_leaves_at_once_and_bad_requests_say_why(membership):
    ask(membership, {"join": {"address": "127.0.0.1:1002"}})
    assert ask(membership, {"leave": {"index": 2}}) == {"left": True}
    assert membership.states()[2] == "empty"
    assert ask(membership, {"leave": {"index": 2}})["already"] is True
    assert "host:port" in ask(membership, {"join": {"address": "nowhere"}})["error"]
    assert "malformed" in ask(membership, {"join": {"port": 3}})["error"]
    assert "join, leave or status" in ask(membership, {"hello": {}})["error"]


def test_a_slot_moves_only_as_its_state_machine_says(membership):
    slot = membership.slots[2]
    with pytest.raises(RuntimeError, match="cannot go from empty to member"):
        with membership._lock:
            membership._move(slot, SlotState.MEMBER)


def _runtime(devices):
    """A runtime whose workers join and leave at once, and whose cluster changes."""
    return types.SimpleNamespace(
        replica_devices=devices,
        record=types.SimpleNamespace(lost=set, change_cluster=lambda add=None, remove=None: True),
        training=lambda: False,
        join_replicas=lambda task, replicas: None,
        leave_replicas=lambda task, replicas, timeout: [],
    )


def test_the_chief_logs_the_command_that_adds_a_worker(caplog):
    devices = [f"/job:worker/replica:0/task:{i}/device:CPU:{c}" for i in range(3) for c in (0, 1)]
    cluster = {
        "chief": ["127.0.0.1:1999"],
        "worker": ["127.0.0.1:1000", "127.0.0.1:1001"],
        "ps": ["127.0.0.1:2000"],
    }
    with caplog.at_level("INFO", logger="tf_diffmap"):
        m = Membership(_runtime(devices), {0: "127.0.0.1:1000", 1: "127.0.0.1:1001"}, cluster, 0)
    try:
        command = (
            f"env -u TF_CONFIG python -m tf_diffmap.cluster --join 127.0.0.1:{m.port} "
            "--logical-cpus 2 --address 127.0.0.1"
        )
        assert m.join_command() == command
        (record,) = [r for r in caplog.records if command in r.getMessage()]
        assert record.levelname == "INFO"
        assert "2 of its 3 worker slots are held" in record.getMessage()
    finally:
        m.stop()


def test_join_command_gives_a_remote_chief_no_address_and_gpus_no_logical_cpus():
    gpus = [
        "/job:worker/replica:0/task:0/device:GPU:0",
        "/job:worker/replica:0/task:0/device:GPU:1",
    ]
    assert join_command("chief.example:2223", gpus) == (
        "env -u TF_CONFIG python -m tf_diffmap.cluster --join chief.example:2223"
    )
    one_cpu = ["/job:worker/replica:0/task:0/device:CPU:0"]
    assert join_command("localhost:2223", one_cpu).endswith(
        "--join localhost:2223 --address localhost"
    )


def test_routine_joins_and_leaves_are_info_and_a_refused_join_warns(monkeypatch, caplog):
    """A worker joining and leaving is what the elastic cluster is for: INFO.
    A worker whose devices do not fit its slot needs the user: WARNING."""
    import tensorflow as tf

    from tf_diffmap.cluster import membership as module

    devices = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(3)]
    found = devices[:2]
    monkeypatch.setattr(module, "serves", lambda address, timeout: True)
    monkeypatch.setattr(
        tf.config, "list_logical_devices", lambda: [types.SimpleNamespace(name=d) for d in found]
    )
    cluster = {"worker": ["127.0.0.1:1000", "127.0.0.1:1001"], "ps": ["127.0.0.1:2000"]}
    m = Membership(_runtime(devices), {0: "127.0.0.1:1000", 1: "127.0.0.1:1001"}, cluster, 0)

    def join_and_wait() -> str:
        assert ask(m, {"join": {"address": "127.0.0.1:1002"}})["index"] == 2
        deadline = time.monotonic() + 30
        while m.states()[2] == "expected" and time.monotonic() < deadline:
            time.sleep(0.05)
        return m.states()[2]

    try:
        with caplog.at_level("INFO", logger="tf_diffmap"):
            # Its devices are not those of its slot: refused, with a warning.
            assert join_and_wait() == "empty"
            (refused,) = [r for r in caplog.records if "could not join" in r.getMessage()]
            assert refused.levelname == "WARNING"
            caplog.clear()
            found.append(devices[2])
            assert join_and_wait() == "member"
            assert ask(m, {"leave": {"index": 2}})["left"] is True
        routine = [
            r.levelname
            for r in caplog.records
            if "joined in" in r.getMessage() or "left after" in r.getMessage()
        ]
        assert routine == ["INFO", "INFO"]
        assert [r for r in caplog.records if r.levelname == "WARNING"] == []
    finally:
        m.stop()


def test_a_leave_waits_for_its_replicas_without_holding_the_members_lock():
    """While a leaving worker's replicas finish, a new input for the next
    `fit` (or a worker that rejoins) takes the runtime's members lock at once."""
    import threading

    from tf_diffmap.engine.runtime import Runtime

    finishing = threading.Event()
    marked = []
    runtime = Runtime.__new__(Runtime)
    runtime._members_lock = threading.RLock()
    runtime._feeds = [
        types.SimpleNamespace(leave=lambda replicas, timeout: finishing.wait(20.0) and [])
    ]
    runtime.record = types.SimpleNamespace(mark_absent=marked.append)
    runtime.worker_input = None
    left = []
    leaving = threading.Thread(
        target=lambda: left.append(runtime.leave_replicas("task", [2], 30.0)), daemon=True
    )
    leaving.start()
    try:
        time.sleep(0.2)
        assert leaving.is_alive()  # its replicas are still finishing
        assert runtime._members_lock.acquire(timeout=2.0)
        runtime._members_lock.release()
    finally:
        finishing.set()
        leaving.join(10.0)
    assert left == [[]] and marked == [[2]]
