"""The strategy on TensorFlow's distributed runtime: separate processes, 127.0.0.1.

Every process a test stops is one it started (or one a `LocalCluster` of the
test started), and it is stopped by its pid.
"""

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from cluster_chief import run_chief_script

import tf_diffmap
from tf_diffmap import cluster
from tf_diffmap.cluster import parse_local_spec

pytestmark = pytest.mark.timeout(240)

CHILD_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_gone(pids, seconds=15.0):
    """The pids still alive after waiting up to `seconds` for them to exit."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def accepts(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def start_bystander():
    """A process of this test that no cluster may touch."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])


# The example of docs/cluster.md: the chief's process starts the cluster and trains on it.
CLIENT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf
    from tf_diffmap import cluster

    with cluster.LocalCluster(workers=2, ps=2, cpus_per_worker=2) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
        y = (x.sum(axis=1) > 0).astype("int32")
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                      keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
        before = model.evaluate(x, y, verbose=0)[0]
        model.fit(x, y, batch_size=32, epochs=3, verbose=0)
        after = model.evaluate(x, y, verbose=0)[0]
        # Where the replicas' loops do their bookkeeping on the counters.
        from tf_diffmap.store.parameter_store import BOOKKEEPING_SCOPE
        from tf_diffmap._tf_internal import PACKED_SCOPE
        bookkeeping, packs = set(), set()
        task = lambda device: device.split("/device")[0]
        for program in strategy.extended.runtime.feeds():
            for concrete in program.loop_concretes.values():
                for function in concrete.graph.as_graph_def().library.function:
                    bookkeeping.update(
                        node.device for node in function.node_def
                        if BOOKKEEPING_SCOPE + "/" in node.name
                    )
                    # Which tasks each pack of crossing values goes between.
                    ends = {}
                    for node in function.node_def:
                        if PACKED_SCOPE + "/" in node.name and node.op in ("ConcatV2", "SplitV"):
                            name = node.name.rsplit("/", 1)[1]
                            pack = name.replace("concat", "").replace("split", "")
                            ends.setdefault(pack, {})[node.op] = task(node.device)
                    packs.update((e["ConcatV2"], e["SplitV"]) for e in ends.values())
        # What the chief's Keras loop iterates, and where the replicas' input is.
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        chief_batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
        worker_batches = [next(it) for it in strategy.extended.runtime.worker_input.iterators]
        report = {
            "chief_rows": [int(t.shape[0]) for t in chief_batch],
            "worker_rows": [int(b[0].shape[0]) for b in worker_batches],
            "worker_batch_devices": [b[0].device for b in worker_batches],
            "examples": strategy.statistics().examples.tolist(),
            "replicas": list(strategy.replica_devices),
            "store": sorted({w.value.device for w in model.weights}),
            "metric_variables": sorted(
                {v.value.device for m in model.metrics for v in m.variables}
            ),
            "bookkeeping": sorted(bookkeeping),
            "packs": sorted(packs),
            "version": strategy.version,
            "updates": strategy.statistics().updates.tolist(),
            "dropped": strategy.statistics().dropped.tolist(),
            "before": before, "after": after, "pids": list(local.pids.values()),
        }
    print(json.dumps(report))
    """
)


def run_chief(script: str, tmp_path, *args: str) -> dict:
    """Runs a chief script in a process of its own; returns its last line's JSON."""
    return run_chief_script(script, tmp_path, *args, timeout=200, log_level="2")


@pytest.mark.slow
def test_training_across_worker_and_ps_processes(tmp_path):
    report = run_chief(CLIENT, tmp_path)
    # Two worker tasks of two logical CPUs each: four replicas.
    assert report["replicas"] == [
        f"/job:worker/replica:0/task:{task}/device:CPU:{cpu}" for task in (0, 1) for cpu in (0, 1)
    ]
    assert {d.split("/device")[0] for d in report["store"]} == {
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    }
    # A step's bookkeeping and its metrics' totals are on the chief, beside
    # the counters and the outputs: only the values they need cross tasks.
    chief = "/job:chief/replica:0/task:0/device:CPU:0"
    assert report["bookkeeping"] == [chief]
    assert report["metric_variables"] == [chief]
    # The parameters each ps task sends a replica, and the gradients sent
    # back, travel as one tensor each way; so do the metrics' updates.
    workers = [f"/job:worker/replica:0/task:{t}" for t in (0, 1)]
    ps = [f"/job:ps/replica:0/task:{t}" for t in (0, 1)]
    packs = {tuple(p) for p in report["packs"]}
    assert {(p, w) for p in ps for w in workers} <= packs
    assert {(w, p) for p in ps for w in workers} <= packs
    assert {(w, chief.split("/device")[0]) for w in workers} <= packs
    # Every shard's gradient claimed a version: accepted, or dropped by the
    # default's bound on the staleness in optimizer steps.
    assert report["version"] == 3 * 16 * 4 == sum(report["updates"]) + sum(report["dropped"])
    assert min(report["updates"]) > 0
    # Each worker task built its own pipeline: the chief's loop iterates
    # empty tokens, the batches are made on the workers, in per-replica
    # batches (32 / 4 replicas), and the replicas saw every example.
    assert report["chief_rows"] == [0, 0]
    assert report["worker_rows"] == [8, 8]
    assert [d.split("/device")[0] for d in report["worker_batch_devices"]] == [
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    ]
    assert sum(report["examples"]) == 3 * 512
    assert report["after"] < report["before"]
    assert len(report["pids"]) == 4
    assert wait_gone(report["pids"]) == []


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_local_cluster_starts_and_stops_exactly_its_processes():
    bystander = start_bystander()
    try:
        with cluster.LocalCluster(workers=2, ps=1) as local:
            pids = local.pids
            log_dir = local.log_dir
            launcher = local.launcher_pid
            assert sorted(pids) == [("ps", 0), ("worker", 0), ("worker", 1)]
            assert len(set(pids.values())) == 3 and bystander.pid not in pids.values()
            assert all(alive(pid) for pid in [*pids.values(), launcher])
            # Each server is a session of its own, forked from the launcher.
            assert all(os.getsid(pid) == pid for pid in pids.values())
            spec = local.cluster_spec
            assert sorted(spec) == ["chief", "ps", "worker"]
            assert all(accepts(a) for job in ("worker", "ps") for a in spec[job])
            for task_type in ("worker", "ps"):
                stdout, stderr = local.log_files(task_type, 0)
                assert '"serving"' in stdout.read_text() and stderr.exists()
            chief = json.loads(local.tf_config("chief", 0))
            assert chief == {"cluster": spec, "task": {"type": "chief", "index": 0}}
            resolver = local.resolver()
            assert resolver.task_type == "chief" and resolver.task_id == 0
            assert resolver.master() == "grpc://" + spec["chief"][0]
            assert resolver.cluster_spec().as_dict() == spec
        for pid in [*pids.values(), launcher]:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert local.launcher_pid is None
        assert not log_dir.exists(), "a clean exit removes its temporary logs"
        assert bystander.poll() is None, "the cluster stopped a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()


CHECK_WORKERS = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import tensorflow as tf
    from tf_diffmap import cluster

    replicas, store = cluster.connect()
    sums = {}
    for device in replicas:
        with tf.device(device):
            sums[device] = float(tf.reduce_sum(tf.identity(tf.ones([3])) * 2.0).numpy())
    print(json.dumps(sums))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_worker_restarts_and_serves_at_its_port(tmp_path):
    with cluster.LocalCluster(workers=2, ps=1, log_dir=tmp_path) as local:
        address = local.cluster_spec["worker"][1]
        first = local.pids[("worker", 1)]
        local.kill("worker", 1)
        assert not alive(first) and not local.is_running("worker", 1)
        assert not accepts(address)
        with pytest.raises(ValueError, match="not running"):
            local.kill("worker", 1)

        second = local.restart("worker", 1)
        assert second != first and local.pids[("worker", 1)] == second
        assert local.is_running("worker", 1) and accepts(address)
        assert local.log_files("worker", 1)[0].name == "worker-1.2.out"

        # Ctrl-C stops a server (its `join` would otherwise never see it).
        os.kill(local.pids[("worker", 0)], signal.SIGINT)
        deadline = time.monotonic() + 20
        while local.is_running("worker", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not local.is_running("worker", 0)
        local.restart("worker", 0)

        chief = subprocess.run(
            [sys.executable, "-c", CHECK_WORKERS],
            env=dict(CHILD_ENV, TF_CONFIG=local.tf_config("chief", 0)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert chief.returncode == 0, chief.stderr[-3000:]
        sums = json.loads(chief.stdout.strip().splitlines()[-1])
        assert sums == {
            "/job:worker/replica:0/task:0/device:CPU:0": 6.0,
            "/job:worker/replica:0/task:1/device:CPU:0": 6.0,
        }
        pids = list(local.pids.values())
    assert wait_gone(pids, 1) == []
    assert (tmp_path / "worker-1.out").exists(), "a given log_dir is kept"


@pytest.mark.slow  # starts server processes
@pytest.mark.timeout(60)
def test_a_server_that_cannot_start_is_named_with_its_stderr(tmp_path):
    local = cluster.LocalCluster(workers=1, ps=1, log_dir=tmp_path)
    host, port = local.cluster_spec["worker"][0].rsplit(":", 1)
    taken = socket.socket()
    taken.bind((host, int(port)))  # no SO_REUSEPORT: the worker cannot bind it
    taken.listen()
    try:
        with pytest.raises(RuntimeError, match=r"worker 0 \(pid \d+, .*\) exited with code") as e:
            local.start()
    finally:
        taken.close()
    assert "stderr" in str(e.value) and str(tmp_path / "worker-0.err") in str(e.value)
    assert wait_gone(list(local.pids.values()), 1) == []


@pytest.mark.timeout(60)
def test_a_server_that_does_not_serve_in_time_is_a_timeout_and_is_stopped(tmp_path):
    local = cluster.LocalCluster(workers=1, ps=1, start_timeout=0.2, log_dir=tmp_path)
    with pytest.raises(TimeoutError, match="did not start serving within 0.2 s"):
        local.start()
    assert wait_gone(list(local.pids.values()), 1) == []
    assert local.launcher_pid is None  # stopped with the cluster
    with pytest.raises(RuntimeError, match="starts once"):
        local.start()


def test_local_cluster_arguments_and_tasks_are_checked():
    with pytest.raises(ValueError, match=r"workers >= 1, received 0"):
        cluster.LocalCluster(workers=0)
    with pytest.raises(ValueError, match=r"cpus_per_worker >= 1"):
        cluster.LocalCluster(cpus_per_worker=0)
    local = cluster.LocalCluster(workers=1, ps=1, chief=False)
    assert sorted(local.cluster_spec) == ["ps", "worker"]
    with pytest.raises(ValueError, match="chief=False"):
        local.resolver()
    with pytest.raises(ValueError, match="no task 'worker' 1"):
        local.tf_config("worker", 1)
    with pytest.raises(ValueError, match="starts only worker and ps"):
        cluster.LocalCluster().kill("chief", 0)
    with pytest.raises(RuntimeError, match="needs a started LocalCluster"):
        local.restart("worker", 0)
    assert json.loads(local.tf_config("ps", 0))["task"] == {"type": "ps", "index": 0}


@pytest.mark.parametrize(
    "text, expected",
    [
        ("workers=2,ps=1", {"workers": 2, "ps": 1}),
        ("workers=3,ps=2", {"workers": 3, "ps": 2}),
        (" worker = 1 , ps=2", {"workers": 1, "ps": 2}),
        ("ps=2", {"workers": 2, "ps": 2}),
    ],
)
def test_local_spec(text, expected):
    assert parse_local_spec(text) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("nodes=2", "unknown job 'nodes'"),
        ("chief=1", "chief is not started by --local"),
        ("workers=0", "at least 1, received '0'"),
        ("ps=-1", "at least 1, received '-1'"),
        ("workers=two", "at least 1, received 'two'"),
        ("workers", "'workers' is not job=count"),
        ("workers=2,", "'' is not job=count"),
        ("workers=2,workers=3", "given twice"),
    ],
)
def test_bad_local_spec_says_what_and_shows_an_example(text, message):
    with pytest.raises(ValueError, match="for example --local workers=2,ps=1") as e:
        parse_local_spec(text)
    assert message in str(e.value)


def test_cli_refuses_a_bad_local_spec_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as e:
        cluster.main(["--local", "workers=2,ps=0"])
    assert e.value.code == 2
    assert "ps needs a whole number of at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cluster.main(["--logical-cpus", "0"])
    assert "--logical-cpus needs N >= 1" in capsys.readouterr().err


def test_join_refuses_the_chiefs_tf_config_before_taking_the_signals(monkeypatch, capsys):
    """A worker started with --join in the chief's shell inherits its
    TF_CONFIG: refused with the way out, and Ctrl-C still works as before."""
    spec = {"chief": ["127.0.0.1:1999"], "worker": ["127.0.0.1:1000"], "ps": ["127.0.0.1:2000"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}})
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as e:
        cluster.main(["--join", "127.0.0.1:2000"])
    assert e.value.code == 2
    error = capsys.readouterr().err
    assert "TF_CONFIG names task 'chief' 0" in error
    assert "env -u TF_CONFIG python -m tf_diffmap.cluster --join" in error
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_joining_worker_given_a_host_alone_listens_on_a_port_of_its_own():
    from tf_diffmap.cluster.member import _with_port

    assert _with_port("127.0.0.1", 5000) == "127.0.0.1:5000"
    assert _with_port("worker-3.example:2222", 5000) == "worker-3.example:2222"
    host, _, port = _with_port("127.0.0.1", None).rpartition(":")
    assert host == "127.0.0.1" and 0 < int(port) < 65536
    assert _with_port("[::1]", 7) == "[::1]:7"


def read_lines_until(process, marker, seconds):
    """The stdout lines of `process` up to the one starting with `marker`."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in process.stdout] + [lines.put(None)],
        daemon=True,
    ).start()
    seen = []
    deadline = time.monotonic() + seconds
    while True:
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        if line is None:
            raise AssertionError(f"stdout ended before {marker!r}: {seen}")
        seen.append(line.rstrip("\n"))
        if line.startswith(marker):
            return seen


@pytest.mark.slow
def test_the_command_keeps_tensorflows_informational_lines_out():
    """`python -m tf_diffmap.cluster` sets TF_CPP_MIN_LOG_LEVEL=1 unless it is
    set: a server's log holds no session options dump, nor TensorFlow's
    start-up lines (but the oneDNN notice, written before the level is
    read, see docs/troubleshooting.md). The server serves one worker task
    until its standard input, empty, ends."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    (port,) = cluster.local.free_ports(1)
    env["TF_CONFIG"] = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}
    )
    server = ["-m", "tf_diffmap.cluster", "--exit-when-stdin-closes"]

    def informational(args: list[str], **more: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, *args],
            env={**env, **more},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        return [
            line
            for line in result.stderr.splitlines()
            if line[:1] == "I" and line[1:5].isdigit() and "oneDNN custom operations" not in line
        ]

    if not informational(["-c", "import tensorflow"]):
        pytest.skip("TensorFlow writes no informational line at start-up here")
    assert informational(server) == []
    # A level that is set is kept.
    assert informational(server, TF_CPP_MIN_LOG_LEVEL="0")


def _command_line(*args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Runs `python -X importtime -m tf_diffmap.cluster ARGS` on this checkout;
    returns the result and the modules it imported."""
    checkout = str(Path(tf_diffmap.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (checkout, os.environ.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tf_diffmap.cluster", *args],
        env={**os.environ, "PYTHONPATH": path},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
    )
    imported = [
        line.rpartition("|")[2].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    ]
    return result, imported


def test_help_and_argument_errors_answer_without_importing_tensorflow():
    result, imported = _command_line("--help")
    assert result.returncode == 0 and "--join" in result.stdout, result.stderr[-2000:]
    assert "tf_diffmap.cluster.cli" in imported  # -X importtime listed the imports
    assert not [m for m in imported if m.split(".")[0] in ("tensorflow", "keras")]
    for args, message in [
        (["--logical-cpus", "0"], "--logical-cpus needs N >= 1"),
        (["--local", "chief=1"], "unknown job 'chief'"),
        (["--address", "127.0.0.1"], "--address goes with --join"),
        (["--no-such-flag"], "unrecognized arguments"),
    ]:
        result, imported = _command_line(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
        assert not [m for m in imported if m.split(".")[0] in ("tensorflow", "keras")], args


def test_the_packages_names_load_on_first_use_as_they_are_imported():
    """Under `python -m tf_diffmap.cluster` the names of `tf_diffmap` and
    `tf_diffmap.cluster` load from their `_HOMES` on first use: the same
    objects the imports give everywhere else, and every name."""
    import importlib

    for package in (tf_diffmap, cluster):
        exported = set(package.__all__) - {"__version__"}
        assert set(package._HOMES) == exported, package.__name__
        for name, home in package._HOMES.items():
            module = importlib.import_module(home)
            found = getattr(module, name, module)  # `tf_diffmap.testing` is a module
            assert found is getattr(package, name), (package.__name__, name)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_cli_prints_the_chief_tf_config_and_its_servers_end_with_it(stop, tmp_path):
    """SIGTERM stops the servers in order; after a SIGKILL they see their stdin close."""
    process = subprocess.Popen(
        [sys.executable, "-m", "tf_diffmap.cluster", "--local", "workers=2,ps=1"],
        env=dict(CHILD_ENV, TMPDIR=str(tmp_path)),  # its logs, even after a SIGKILL
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = read_lines_until(process, "Serving until", 90)
        pids = [int(line.rsplit("pid ", 1)[1]) for line in lines if " pid " in line]
        assert len(pids) == 3 and all(alive(pid) for pid in pids)
        (config_line,) = [line for line in lines if line.startswith("{")]
        config = json.loads(config_line)
        assert config["task"] == {"type": "chief", "index": 0}
        assert [len(config["cluster"][job]) for job in ("worker", "ps", "chief")] == [2, 1, 1]
        assert all(accepts(a) for job in ("worker", "ps") for a in config["cluster"][job])
        process.send_signal(stop)
        assert process.wait(timeout=60) == (0 if stop == signal.SIGTERM else -stop)
        assert wait_gone(pids, 15) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_a_process_that_is_not_a_client_is_refused(monkeypatch):
    spec = {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}})
    )
    with pytest.raises(ValueError, match="must be one of .*chief"):
        cluster.connect()


def test_no_cluster_says_what_to_set(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="set TF_CONFIG"):
        cluster.connect()


SECOND_FIT_CLIENT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf
    import tf_diffmap
    from tf_diffmap import cluster

    x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with cluster.LocalCluster(workers=2, ps=1) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        first = strategy.statistics()
        # Another dataset: the same examples in batches of 8 (4 per replica),
        # with batch-level staleness points (on a cluster, sampled by the
        # callback's thread: Keras' step does not reach the ps).
        logdir = os.path.join(os.environ["TMPDIR"], "logs")
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(8), epochs=1, verbose=0,
                  callbacks=[tf_diffmap.StalenessTensorBoard(logdir, update_freq="batch")])
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        events = EventAccumulator(os.path.join(logdir, "staleness"), size_guidance={"tensors": 0})
        events.Reload()
        updates = [tf.make_ndarray(e.tensor_proto).item()
                   for e in events.Tensors("work/updates/all")]
        # Two replicas aggregate two gradients to an optimizer step: the
        # sampled points have the staleness in steps too.
        in_steps = [tf.make_ndarray(e.tensor_proto)[:, 2].sum()
                    for e in events.Tensors("staleness/steps/distribution/all")]
        report = {
            "optimizer_steps": [tf.make_ndarray(e.tensor_proto).item()
                                for e in events.Tensors("store/optimizer_steps")],
            "statistics_steps": strategy.statistics().steps,
            "point_updates_in_steps": float(sum(in_steps)),
            "first": int(first.examples.sum()),
            "second": int(strategy.statistics().examples.sum() - first.examples.sum()),
            "version": strategy.version,
            "point_steps": [e.step for e in events.Tensors("work/updates/all")],
            "point_updates": sum(updates),
            "fit_updates": int(strategy.statistics().updates.sum() - first.updates.sum()),
            "fit_dropped": int(strategy.statistics().dropped.sum() - first.dropped.sum()),
        }
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_a_second_fit_reads_its_own_dataset_on_the_workers(tmp_path):
    # Keras keeps its traced step from fit to fit; the replicas' loops must
    # read the pipelines of the dataset the second fit distributed.
    report = run_chief(SECOND_FIT_CLIENT, tmp_path)
    assert report["first"] == 512
    assert report["second"] == 512, "the loops read the first fit's pipelines"
    assert report["version"] == 16 * 2 + 64 * 2
    # Batch-level points on a cluster: the epoch's last batch has its point
    # (after the epoch's updates landed), and the points add up to every update.
    steps = report["point_steps"]
    assert steps and steps[-1] == 64 and steps == sorted(set(steps)), steps
    # The default's bound on the staleness in steps may drop a gradient (on
    # a busy host it does, now and then): applied and dropped make the 128.
    assert report["point_updates"] == report["fit_updates"]
    assert report["fit_updates"] + report["fit_dropped"] == 64 * 2
    assert report["point_updates_in_steps"] == 64 * 2
    steps = report["optimizer_steps"]
    assert steps == sorted(steps) and steps[-1] == report["statistics_steps"]


VALIDATION_CLIENT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np
    from cluster_chief import toy_task
    from tf_diffmap import cluster

    with cluster.LocalCluster(workers=2, ps=1) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        x, y, model = toy_task(strategy, 512, 0.1, ["accuracy"])
        vx, vy = x[:192] + 0.5, y[:192]  # not the training data
        seen = []
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: seen.append(logs["val_loss"]))
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0,
                            validation_data=(vx, vy), callbacks=[record])
        report = {
            "history": history.history,
            "callback_val_loss": seen,
            "evaluate": model.evaluate(vx, vy, verbose=0),
            "examples": int(strategy.statistics().examples.sum()),
        }
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_validation_figures_on_a_cluster_are_evaluates(tmp_path):
    """`fit(validation_data=...)` evaluates the validation data as
    `evaluate` does, and every epoch trains on the training data."""
    report = run_chief(VALIDATION_CLIENT, tmp_path)
    history = report["history"]
    assert len(history["val_loss"]) == 3
    assert report["callback_val_loss"] == history["val_loss"]
    assert all(loss > 0 for loss in history["val_loss"]), history
    assert all(0.5 < accuracy <= 1 for accuracy in history["val_accuracy"]), history
    # The last epoch's validation is evaluate's, on the same (trained) weights.
    loss, accuracy = report["evaluate"]
    assert history["val_loss"][-1] == pytest.approx(loss, rel=1e-4)
    assert history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-6)
    # The validation data never became the workers' training input.
    assert report["examples"] == 3 * 512


FUNCTION_CLIENT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf
    from tf_diffmap import cluster

    x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    contexts = []

    def dataset_fn(context):
        contexts.append([context.num_input_pipelines, context.input_pipeline_id,
                         context.get_per_replica_batch_size(32)])
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shard(context.num_input_pipelines, context.input_pipeline_id)
        return ds.batch(context.get_per_replica_batch_size(32))

    with cluster.LocalCluster(workers=2, ps=1) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        report = {}
        stateful = tf.data.Dataset.from_tensor_slices(x).map(
            lambda t: tf.py_function(lambda a: a, [t], tf.float32)).batch(8)
        try:
            strategy.experimental_distribute_dataset(stateful)
        except ValueError as error:
            report["stateful_error"] = str(error)
        with strategy.scope():
            model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=2, verbose=0)
        report.update({
            "contexts": contexts,
            "version": strategy.version,
            "examples": strategy.statistics().examples.tolist(),
        })
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_dataset_functions_run_on_each_worker_and_stateful_datasets_are_refused(tmp_path):
    report = run_chief(FUNCTION_CLIENT, tmp_path)
    assert "cannot be rebuilt on another task" in report["stateful_error"]
    assert "distribute_datasets_from_function" in report["stateful_error"]
    # Two pipelines, one per worker task, each making per-replica batches
    # (32 over 2 replicas).
    assert report["contexts"] == [[2, 0, 16], [2, 1, 16]]
    # Each worker's 256 examples make 16 batches of 16: 32 per epoch in all,
    # one update each (tokens per epoch: 32 batches / 2 replicas per step).
    assert report["version"] == 2 * 32
    assert sum(report["examples"]) == 2 * 512


# One replica, so that training is the same sequence of updates every time:
# with and without packing what crosses between tasks, the weights must agree.
PACKING_CLIENT = textwrap.dedent(
    """
    import json, os, sys
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf
    import tf_diffmap
    from tf_diffmap import _tf_internal, cluster

    if sys.argv[1] == "unpacked":
        _tf_internal.pack_crossings = lambda graph: 0
    keras.mixed_precision.set_global_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    keras.utils.set_random_seed(0)
    with cluster.LocalCluster(workers=1, ps=2) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((8,)),
                keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.ReLU(),
                keras.layers.Dense(16), keras.layers.BatchNormalization(), keras.layers.ReLU(),
                keras.layers.Dense(2, dtype="float32"),
            ])
            model.compile(
                optimizer=tf_diffmap.AsyncOptimizer(keras.optimizers.Adam(0.01), staleness="dc"),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        before = model.evaluate(x, y, verbose=0)[0]
        history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
        after = model.evaluate(x, y, verbose=0)[0]
        packs = 0
        for program in strategy.extended.runtime.feeds():
            for concrete in program.loop_concretes.values():
                for function in concrete.graph.as_graph_def().library.function:
                    packs += sum(
                        node.op == "ConcatV2" and _tf_internal.PACKED_SCOPE + "/" in node.name
                        for node in function.node_def
                    )
        report = {
            "weights": [w.tolist() for w in model.get_weights()],
            "loss": history.history["loss"], "before": before, "after": after,
            "version": strategy.version, "packs": packs,
        }
    print(json.dumps(report))
    """
)


@pytest.mark.slow
def test_packing_what_crosses_between_tasks_changes_no_value(tmp_path):
    """Mixed precision, batch normalization (whose moving statistics the
    worker computes and the ps keeps), two ps tasks, and the delay
    compensation rule, which reads the values the step read."""
    import numpy as np

    reports = {mode: run_chief(PACKING_CLIENT, tmp_path, mode) for mode in ("packed", "unpacked")}
    packed, unpacked = reports["packed"], reports["unpacked"]
    assert packed["packs"] > 0 and unpacked["packs"] == 0
    assert packed["version"] == unpacked["version"] == 2 * 256 // 32
    assert packed["after"] < packed["before"]
    assert packed["loss"] == unpacked["loss"]
    for mine, theirs in zip(packed["weights"], unpacked["weights"]):
        np.testing.assert_array_equal(np.array(mine), np.array(theirs))
