"""The strategy on TensorFlow's distributed runtime: separate processes, 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(240)


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


CLIENT = textwrap.dedent(
    """
    import json, os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np
    import tf_diffmap
    from tf_diffmap import cluster

    strategy = cluster.strategy_for_cluster()
    x = np.random.default_rng(0).normal(size=(512, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.evaluate(x, y, verbose=0)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    after = model.evaluate(x, y, verbose=0)
    stats = strategy.statistics()
    print(json.dumps({
        "replicas": list(strategy.replica_devices),
        "store": sorted({w.value.device for w in model.weights}),
        "version": strategy.version,
        "updates": stats.updates.tolist(),
        "before": before, "after": after,
    }))
    """
)


@pytest.mark.slow
def test_training_across_worker_and_ps_processes(tmp_path):
    workers = [f"127.0.0.1:{p}" for p in free_ports(2)]
    ps = [f"127.0.0.1:{p}" for p in free_ports(2)]
    chief = [f"127.0.0.1:{p}" for p in free_ports(1)]
    spec = {"worker": workers, "ps": ps, "chief": chief}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    servers = []
    try:
        for job, tasks in (("worker", workers), ("ps", ps)):
            for index in range(len(tasks)):
                config = json.dumps({"cluster": spec, "task": {"type": job, "index": index}})
                servers.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "tf_diffmap.cluster", "--tf-config", config],
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
        client_env = dict(
            env, TF_CONFIG=json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}})
        )
        result = subprocess.run(
            [sys.executable, "-c", CLIENT],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=200,
        )
    finally:
        for server in servers:
            server.kill()
            server.wait()
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert [r.split("/device")[0] for r in report["replicas"]] == [
        "/job:worker/replica:0/task:0",
        "/job:worker/replica:0/task:1",
    ]
    assert {d.split("/device")[0] for d in report["store"]} == {
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    }
    assert report["version"] == 3 * 16 * 2 == sum(report["updates"])
    assert min(report["updates"]) > 0
    assert report["after"] < report["before"]


def test_a_process_that_is_not_a_client_is_refused(monkeypatch):
    from tf_diffmap import cluster

    spec = {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}
    monkeypatch.setenv(
        "TF_CONFIG", json.dumps({"cluster": spec, "task": {"type": "worker", "index": 0}})
    )
    with pytest.raises(ValueError, match="must be one of .*chief"):
        cluster.connect()


def test_no_cluster_says_what_to_set(monkeypatch):
    from tf_diffmap import cluster

    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ValueError, match="set TF_CONFIG"):
        cluster.connect()
