"""Evaluation and prediction on a cluster, split over the workers present (issue 48).

On a multi-process cluster on 127.0.0.1, `evaluate`, `predict` and the
validation inside `fit` cut each batch into one shard per replica and run
the shards on the replicas of every worker present. What plain Keras
computes on the same weights and data is the reference for per-example
metrics; a metric that counts the examples it saw checks that each example
is counted once, when a worker is lost or hung mid-evaluation too. Each test
runs a chief in a subprocess, which starts its cluster with `LocalCluster`
and kills, pauses and resumes only those processes.
"""

import textwrap

import numpy as np
import pytest
from cluster_chief import run_chief_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = 1003  # odd: the batch sizes below leave a partial last batch
BATCH = 64
BATCHES = -(-EXAMPLES // BATCH)

CHIEF = textwrap.dedent(
    """
    import json, os, sys, threading, time, warnings
    import keras, numpy as np, tensorflow as tf
    from keras import ops
    from cluster_chief import pause_task
    from tf_diffmap import cluster
    from tf_diffmap.cluster.inference import ClusterInference

    scenario, workers, cpus = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    EXAMPLES, BATCH = int(sys.argv[4]), int(sys.argv[5])

    class Seen(keras.metrics.Metric):
        "The examples a metric was updated with."

        def __init__(self, name="seen", **kwargs):
            super().__init__(name=name, **kwargs)
            self.seen = self.add_variable(shape=(), initializer="zeros", name="seen")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.seen.assign_add(ops.cast(ops.shape(y_true)[0], "float32"))

        def result(self):
            return self.seen

    class Peak(keras.metrics.Metric):
        "The largest prediction: a state assigned, not added to."

        def __init__(self, name="peak", **kwargs):
            super().__init__(name=name, **kwargs)
            self.peak = self.add_variable(shape=(), initializer="zeros", name="peak")

        def update_state(self, y_true, y_pred, sample_weight=None):
            self.peak.assign(ops.maximum(self.peak, ops.max(y_pred)))

        def result(self):
            return self.peak

    class DeviceTime(keras.layers.Layer):
        "Sleeps 2 ms an example on the replica's worker: shards take a while."

        def call(self, inputs):
            def sleep(examples):
                time.sleep(0.002 * int(examples))
                return np.bool_(True)

            slept = tf.numpy_function(sleep, [tf.shape(inputs)[0]], tf.bool)
            with tf.control_dependencies([slept]):
                return tf.identity(inputs)

    def build(device_time, extra=()):
        model = keras.Sequential(
            [keras.Input((8,)), *([DeviceTime()] if device_time else []),
             keras.layers.Dense(16, activation="relu"),
             keras.layers.Dense(1, activation="sigmoid")])
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss="binary_crossentropy",
            metrics=["accuracy", keras.metrics.AUC(name="auc"),
                     keras.metrics.Precision(name="precision"),
                     keras.metrics.BinaryCrossentropy(name="crossentropy"), Seen(), *extra])
        return model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, 8)).astype("float32")
    y = (x[:, :4].sum(axis=1) + 0.5 * rng.normal(size=EXAMPLES) > 0).astype("float32")[:, None]
    faults = scenario in ("killed", "paused")
    report = {}
    with cluster.LocalCluster(workers=workers, ps=1, cpus_per_worker=cpus) as local:
        strategy = cluster.strategy_for_cluster(
            local.resolver(), worker_timeout=5.0 if scenario == "paused" else 60.0)
        with strategy.scope():
            model = build(faults)
        plain = build(faults)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        plain.set_weights(model.get_weights())

        def inference():
            steps = [s for s in strategy.extended._steps.values()
                     if isinstance(s, ClusterInference)]
            return {
                "shards_run": [sum(s.shards_run[r] for s in steps)
                               for r in range(len(strategy.replica_devices))],
                "shards": [s.pieces for s in steps],
                "run_again": sum(s.shards_run_again for s in steps),
            }

        def both(call, **kwargs):
            "The strategy's figures and plain Keras' on the same weights."
            return call(model, **kwargs), call(plain, **kwargs)

        evaluate = lambda m, **kw: m.evaluate(x, y, batch_size=BATCH, verbose=0,
                                              return_dict=True, **kw)
        if scenario == "split":
            report["evaluate"] = both(evaluate)
            report["after_evaluate"] = inference()
            report["steps"] = both(evaluate, steps=5)
            unknown = tf.data.Dataset.from_tensor_slices((x, y)).filter(
                lambda a, b: a[0] > -10.0).batch(50)
            assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
            report["unknown_length"] = both(
                lambda m: m.evaluate(unknown, verbose=0, return_dict=True))
            got, want = both(lambda m: m.predict(x, batch_size=BATCH, verbose=0))
            report["predict_difference"] = float(np.abs(got - want).max())
            history = model.fit(x[:800], y[:800], validation_data=(x[800:], y[800:]),
                                batch_size=32, epochs=1, verbose=0)
            plain.set_weights(model.get_weights())
            report["validation"] = [
                {k[len("val_"):]: v[-1] for k, v in history.history.items()
                 if k.startswith("val_")},
                plain.evaluate(x[800:], y[800:], batch_size=32, verbose=0, return_dict=True),
            ]
        elif scenario == "worker0_gone":
            with strategy.scope():
                peaked = build(False, [Peak()])
            peaked.set_weights(model.get_weights())
            local.kill("worker", 0)
            report["evaluate"] = both(evaluate)
            got, want = both(lambda m: m.predict(x, batch_size=BATCH, verbose=0))
            report["predict_difference"] = float(np.abs(got - want).max())
            report["after_evaluate"] = inference()
            # A step that assigns a variable: whole batches, on worker 1.
            plain_peaked = build(False, [Peak()])
            plain_peaked.set_weights(model.get_weights())
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                report["assigned"] = [evaluate(peaked), evaluate(plain_peaked)]
            report["assigned_warned"] = any(
                "runs each batch whole" in str(w.message) for w in caught)
            report["after_assigned"] = inference()
        else:
            pid = local.pids[("worker", 1)]

            class Fault(keras.callbacks.Callback):
                def on_test_batch_end(self, batch, logs=None):
                    if batch == 5:
                        # Stopped, its call of the next batch's shard waits:
                        # killed then, the worker dies mid-call.
                        pause_task(pid)
                        if scenario == "killed":
                            threading.Timer(1.0, local.kill, ("worker", 1)).start()

            report["evaluate"] = [evaluate(model, callbacks=[Fault()]), evaluate(plain)]
            report["after_evaluate"] = inference()
            report["states"] = [r.state for r in strategy.replica_states()]
            if scenario == "paused":
                os.kill(pid, 18)  # SIGCONT: it answers, and rejoins
            # Once more, with worker 1 lost (or back).
            report["again"] = both(evaluate)
    print(json.dumps(report))
    os._exit(0)
    """
)


def run_chief(scenario: str, tmp_path, workers: int, cpus: int = 1) -> dict:
    args = (scenario, str(workers), str(cpus), str(EXAMPLES), str(BATCH))
    return run_chief_script(CHIEF, tmp_path, *args, timeout=280)


def assert_same(pair) -> None:
    """The strategy's figures equal plain Keras', and each example counted once."""
    found, expected = pair
    assert set(found) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(found[name], value, rtol=2e-5, atol=1e-6, err_msg=name)


def test_evaluate_predict_and_validation_split_over_every_worker(tmp_path):
    """Two workers of two replicas: every batch in four shards, on all four;
    figures equal plain Keras', with a partial last batch, `steps=`, a
    dataset of unknown length, `predict` in input order, and `fit`'s
    validation."""
    report = run_chief("split", tmp_path, workers=2, cpus=2)
    assert_same(report["evaluate"])
    assert report["evaluate"][0]["seen"] == EXAMPLES
    assert report["after_evaluate"]["shards"] == [4]
    shards_run = report["after_evaluate"]["shards_run"]
    assert sum(shards_run) == 4 * BATCHES and all(n > 0 for n in shards_run), shards_run
    assert report["after_evaluate"]["run_again"] == 0
    assert_same(report["steps"])
    assert report["steps"][0]["seen"] == 5 * BATCH
    assert_same(report["unknown_length"])
    assert report["predict_difference"] < 1e-6
    assert_same(report["validation"])


def test_evaluate_with_worker_0_gone(tmp_path):
    report = run_chief("worker0_gone", tmp_path, workers=2)
    assert_same(report["evaluate"])
    assert report["evaluate"][0]["seen"] == EXAMPLES
    assert report["predict_difference"] < 1e-6
    shards_run = report["after_evaluate"]["shards_run"]
    assert shards_run[0] == 0 and shards_run[1] == 2 * 2 * BATCHES, shards_run
    # A step that assigns a variable runs each batch whole, with a warning.
    assert_same(report["assigned"])
    assert report["assigned_warned"]
    assert report["after_assigned"]["shards"] == [2, 2, 1]
    assert report["after_assigned"]["shards_run"][1] == 2 * 2 * BATCHES + BATCHES


def test_a_worker_killed_mid_evaluation_has_its_shards_run_again_once(tmp_path):
    report = run_chief("killed", tmp_path, workers=3)
    assert_same(report["evaluate"])
    assert report["evaluate"][0]["seen"] == EXAMPLES  # no example counted twice
    assert report["states"][1] == "lost"
    assert sum(report["after_evaluate"]["shards_run"]) == 3 * BATCHES
    assert report["after_evaluate"]["run_again"] >= 1
    assert_same(report["again"])


def test_a_worker_hung_mid_evaluation_is_left_after_worker_timeout(tmp_path):
    report = run_chief("paused", tmp_path, workers=3)
    assert_same(report["evaluate"])
    assert report["evaluate"][0]["seen"] == EXAMPLES
    assert report["states"][1] == "lost"
    assert sum(report["after_evaluate"]["shards_run"]) == 3 * BATCHES
    assert report["after_evaluate"]["run_again"] >= 1
    assert_same(report["again"])
