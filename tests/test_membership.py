"""The chief's membership endpoint, without a cluster: its requests, replies
and slot states (tests/test_membership_cluster.py joins real workers)."""

import socket
import time
import types

import pytest

from tf_diffmap.cluster.membership import Membership, SlotState, request

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
