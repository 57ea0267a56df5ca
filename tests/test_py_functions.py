"""Python inside a training step: `tf.numpy_function`, never `tf.py_function`.

Each call of a `tf.py_function` (an `EagerPyFunc` op) makes an eager executor
for its thread and frees it on return, while TensorFlow's `async_wait`, which
Keras calls at the end of every epoch, reads every thread's executor without
holding a lock. Under `tf_diffmap.Strategy` the replicas still run at that
moment, so a `tf.py_function` in the step now and then makes the process
abort ("Mutex corrupt"), crash or hang. `tf.numpy_function` (a `PyFunc` op)
makes no executor. The package's own layer uses it, and the strategy warns
of a `tf.py_function` in a training step.
"""

import inspect
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import pytest
import tensorflow as tf

import tf_diffmap
from tests.conftest import classification_data, compile_logits
from tf_diffmap.engine.replica_step import eager_py_functions


class PythonIdentity(keras.layers.Layer):
    """Passes its input through a Python function of the kind given."""

    def __init__(self, kind: str, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind

    def call(self, inputs):
        make = tf.py_function if self.kind == "py_function" else tf.numpy_function
        passed = make(lambda x: x, [inputs], tf.float32, name=f"identity_{self.kind}")
        return tf.ensure_shape(passed, inputs.shape)


def _fit_and_catch(layer: keras.layers.Layer, where: list | None = None) -> list[str]:
    """Fits a small model holding `layer` under the strategy; the warnings.

    `where`, if given, receives each warning's (filename, line), and then the
    line of the `fit` call.
    """
    x, y = classification_data(n=128)
    with tf_diffmap.Strategy().scope():
        model = keras.Sequential([keras.Input((8,)), layer, keras.layers.Dense(2)])
        compile_logits(model, "sgd")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit_line = inspect.currentframe().f_lineno + 1
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    found = [w for w in caught if "tf.py_function" in str(w.message)]
    if where is not None:
        where.extend((w.filename, w.lineno) for w in found)
        where.append((__file__, fit_line))
    return [str(w.message) for w in found]


def test_replica_delay_makes_no_eager_py_function():
    layer = tf_diffmap.testing.ReplicaDelay(0.001, replicas=[0])
    concrete = tf.function(lambda x: layer(x, training=True)).get_concrete_function(
        tf.TensorSpec([4, 2], tf.float32)
    )
    ops = [op.type for op in concrete.graph.get_operations()]
    assert "PyFunc" in ops, ops
    assert eager_py_functions(concrete) == []


def test_eager_py_functions_finds_those_of_called_functions():
    inner = tf.function(lambda x: tf.py_function(lambda a: a, [x], tf.float32, name="inner"))
    concrete = tf.function(lambda x: inner(x) + 1.0).get_concrete_function(
        tf.TensorSpec([], tf.float32)
    )
    assert [op.type for op in concrete.graph.get_operations()].count("EagerPyFunc") == 0
    assert eager_py_functions(concrete) == ["inner"]


def test_a_py_function_in_the_training_step_is_warned_of():
    where = []
    messages = _fit_and_catch(PythonIdentity("py_function"), where)
    assert len(messages) == 1, messages
    # Given while the step is traced inside `fit`: it names the line of `fit`.
    assert where[0] == where[1]
    assert "identity_py_function" in messages[0]
    assert "tf.numpy_function" in messages[0]


@pytest.mark.parametrize(
    "layer",
    [lambda: PythonIdentity("numpy_function"), lambda: tf_diffmap.testing.ReplicaDelay(0.001)],
    ids=["numpy_function", "ReplicaDelay"],
)
def test_a_numpy_function_in_the_training_step_is_not_warned_of(layer):
    assert _fit_and_catch(layer()) == []


RACE = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.eager import context

    @tf.function
    def step():
        return tf.numpy_function(lambda: time.sleep(0.001) or np.bool_(True), [], tf.bool)

    stop = threading.Event()
    def run():
        while not stop.is_set():
            step()
    threads = [threading.Thread(target=run) for _ in range(16)]
    for thread in threads:
        thread.start()
    start, waits = time.monotonic(), 0
    while time.monotonic() - start < float(sys.argv[1]):
        context.async_wait()  # what Keras calls at the end of each epoch
        waits += 1
    stop.set()
    for thread in threads:
        thread.join()
    print("waits", waits)
    """
)


@pytest.mark.slow
def test_numpy_functions_beside_async_wait_do_not_crash():
    """16 threads in `tf.numpy_function` calls while the main thread calls
    `async_wait` as fast as it can. With `tf.py_function` in their place the
    process aborted within 20 s in each of two runs on a 2-core host
    ("Mutex corrupt: waiting writer with no waiters")."""
    proc = subprocess.run(
        [sys.executable, "-c", RACE, "15"],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TF_NUM_INTEROP_THREADS": "64", "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split("waits")[-1]) > 0, proc.stdout
