"""Bad input gets a clear error naming the value and what to do."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import tf_diffmap
from tests.conftest import async_mlp, classification_data, compile_logits, mlp
from tf_diffmap.devices import compute_device


def test_defaults_use_every_logical_cpu_device():
    strategy = tf_diffmap.Strategy()
    assert len(strategy.replica_devices) == 4
    assert strategy.num_replicas_in_sync == 4
    assert strategy.parameter_devices == ("/device:CPU:0",)


def test_cpu_replicas_compute_on_their_tasks_cpu0():
    """Logical CPU devices share their task's memory and threads: a replica on
    one computes on the task's CPU:0; a GPU replica computes on its GPU."""
    assert compute_device("/device:CPU:3") == "/device:CPU:0"
    worker = "/job:worker/replica:0/task:1/device:CPU:2"
    assert compute_device(worker) == "/job:worker/replica:0/task:1/device:CPU:0"
    assert compute_device("/device:GPU:1") == "/device:GPU:1"
    strategy = tf_diffmap.Strategy()
    assert len(set(strategy.replica_devices)) == 4
    assert strategy.extended.runtime.compute_devices == ["/device:CPU:0"] * 4
    apart = tf_diffmap.Strategy(colocate_cpu_replicas=False)
    assert apart.extended.runtime.compute_devices == list(apart.replica_devices)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"devices": []}, "devices is empty"),
        ({"devices": ["GPU:0"]}, "'GPU:0', which this process does not have"),
        ({"devices": ["CPU:9"]}, "Available devices"),
        ({"devices": ["CPU:0", "cpu:0"]}, "replicas_per_device"),
        ({"devices": ["not a device"]}, "not a device"),
        (
            {"devices": ["cpu0"]},
            "devices holds 'cpu0', which is not a device name; write a device as 'CPU:0', "
            "'GPU:1' or '/job:worker/task:0/device:GPU:1'",
        ),
        ({"devices": ["/job:localhost"]}, "'/job:localhost', which names no device type"),
        ({"parameter_device": "cpu0"}, "parameter_device holds 'cpu0', which is not a device"),
        (
            {"devices": "CPU:0"},
            r"devices takes a list of device names, received the string 'CPU:0'\. "
            r"For one device write devices=\['CPU:0'\]",
        ),
        ({"parameter_device": "CPU:17"}, "parameter_device names 'CPU:17'"),
        ({"replicas_per_device": 0}, "replicas_per_device must be an int >= 1, received 0"),
        ({"max_staleness": -1}, "max_staleness must be None .* received -1"),
        ({"queue_size": 2}, "at least one shard per replica"),
        ({"queue_size": True}, r"queue_size must be None \(two per replica\) or an int >= 1"),
        ({"steps_per_loop": 0}, "steps_per_loop must be an int >= 1, received 0"),
        ({"steps_per_loop": 2.0}, "steps_per_loop must be an int >= 1, received 2.0"),
        ({"worker_timeout": 0}, "worker_timeout must be None"),
        ({"colocate_cpu_replicas": "yes"}, "colocate_cpu_replicas must be True or False"),
    ],
)
def test_bad_options_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tf_diffmap.Strategy(**kwargs)


def test_a_parameter_device_may_be_one_name():
    # Unlike `devices`, where a string is refused, one parameter device is the
    # common case and is documented as "one device, or a list".
    strategy = tf_diffmap.Strategy(parameter_device="CPU:1")
    assert strategy.parameter_devices == ("/device:CPU:1",)


def test_splitting_after_initialization_says_what_to_do():
    with pytest.raises(RuntimeError, match="before creating tensors"):
        tf_diffmap.split_devices(2, "CPU")
    # The configuration already in place is accepted again.
    assert len(tf_diffmap.split_devices(4, "CPU")) == 4


@pytest.mark.parametrize("value", [0, -3, 2.5])
def test_split_devices_rejects_bad_counts(value):
    with pytest.raises(ValueError, match="num_replicas >= 1"):
        tf_diffmap.split_devices(value)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.SGD(0.1),  # no slots: caught when the step is traced
        lambda: keras.optimizers.Adam(1e-3),  # slots: caught when fit builds it
        lambda: "adam",
    ],
    ids=["sgd", "adam", "adam_by_name"],
)
def test_model_built_outside_the_scope_is_refused(optimizer):
    strategy = tf_diffmap.Strategy()
    model = mlp()  # variables created outside the scope
    with strategy.scope():
        compile_logits(model, optimizer())
    x, y = classification_data(64)
    # Not TensorFlow's 'Need to be inside "with strategy.scope()"', which
    # `fit` (run outside the scope, as the documentation says) would make no sense of.
    with pytest.raises(ValueError, match=r"(created outside|not created under) this tf_diffmap"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(ValueError, match=r"Build (and compile )?the model"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


@pytest.mark.slow  # a process of its own
def test_optimizer_created_outside_the_scope_is_named_in_a_fresh_process():
    """An optimizer created before `with strategy.scope():`, with the model
    built inside: the error says so and how to fix it (TensorFlow's own speak
    of nested or mixed strategies). A fresh process, as a user's script."""
    script = textwrap.dedent(
        """
        import keras, numpy as np, tf_diffmap
        tf_diffmap.split_devices(4, "CPU")
        cases = {
            "async": lambda: tf_diffmap.AsyncOptimizer(keras.optimizers.SGD(0.1)),
            "sgd": lambda: keras.optimizers.SGD(0.1),  # no slots: the step's trace
            "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),  # Keras' build
            "adam": lambda: keras.optimizers.Adam(1e-3),
        }
        x, y = np.zeros((64, 4), "float32"), np.zeros((64,), "int32")
        for name, make in cases.items():
            strategy = tf_diffmap.Strategy()
            optimizer = make()
            with strategy.scope():
                model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
                model.compile(optimizer, "sparse_categorical_crossentropy")
            try:
                model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            except Exception as error:
                print(f"{name}|{type(error).__name__}|{error}".replace("\\n", " "))
            else:
                print(f"{name}|no error|")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    seen = {}
    for line in result.stdout.splitlines():
        name, kind, message = line.split("|", 2)
        seen[name] = (kind, message)
    assert set(seen) == {"async", "sgd", "sgd_momentum", "adam"}, result.stdout
    for name, (kind, message) in seen.items():
        assert kind == "ValueError", (name, kind, message)
        assert "was created outside this tf_diffmap.Strategy's scope" in message, name
        assert "Create the optimizer inside `with strategy.scope():`" in message, name
        assert "nest" not in message, name
    # Where the optimizer is in hand, it is named.
    assert "The optimizer (AsyncOptimizer)" in seen["async"][1]
    assert "The optimizer (SGD)" in seen["sgd"][1]


def test_one_default_replica_says_how_to_get_more(monkeypatch, caplog):
    import tf_diffmap.strategy

    # As on a CPU-only host where split_devices was not called.
    monkeypatch.setattr(tf_diffmap.strategy, "default_replica_devices", lambda: ["/device:CPU:0"])
    strategy = tf_diffmap.Strategy()
    assert strategy.num_replicas_in_sync == 1
    (record,) = [r for r in caplog.records if r.name == "tf_diffmap"]
    assert record.levelname == "WARNING"
    assert "one replica" in record.getMessage()
    assert "tf_diffmap.split_devices(n)" in record.getMessage()
    # Several replicas, or devices the user chose, are what was asked for: no warning.
    caplog.clear()
    tf_diffmap.Strategy(replicas_per_device=2)
    tf_diffmap.Strategy(devices=["CPU:0"])
    monkeypatch.undo()
    tf_diffmap.Strategy()
    assert not [r for r in caplog.records if r.name == "tf_diffmap"]


def test_sparse_inputs_are_refused_with_advice():
    import tensorflow as tf

    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,), sparse=True), keras.layers.Dense(2)])
        compile_logits(model)
    x = tf.sparse.from_dense(np.eye(8, dtype="float32")[np.arange(32) % 8])
    ds = tf.data.Dataset.from_tensor_slices((x, np.zeros(32, "int32"))).batch(8)
    with pytest.raises(ValueError, match="dense tensors"):
        model.fit(ds, epochs=1, verbose=0)


def test_jit_compile_is_refused_with_advice():
    strategy, model = async_mlp(compile_kwargs={"jit_compile": True})
    x, y = classification_data(64)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
