"""Tools for trying the strategy out: a layer that makes chosen replicas slow.

Stragglers are what asynchronous training is for, and they are hard to come by
on demand. `ReplicaDelay` sleeps on the replicas it names, keyed by the replica
id of whatever strategy runs the step, so the same delay slows the same replica
under `tf_diffmap.Strategy` and under `tf.distribute.MirroredStrategy` alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import keras
import tensorflow as tf

__all__ = ["ReplicaDelay"]


@keras.saving.register_keras_serializable(package="tf_diffmap")
class ReplicaDelay(keras.layers.Layer):
    """Identity layer that sleeps `seconds` per training step on some replicas.

    The sleep is a `tf.numpy_function` op, so while it sleeps it holds one of
    TensorFlow's inter-op threads, which a slow device would not: on a host
    with few inter-op threads (one per core by default) the other replicas'
    ops have fewer threads meanwhile. Set `TF_NUM_INTEROP_THREADS` higher to
    take that out of a measurement. It is not a `tf.py_function`, which can
    crash the process while replicas run (see Troubleshooting).

    Args:
        seconds: how long each training step of a slowed replica sleeps.
        replicas: the replica ids to slow (replica 0 by default).
        **kwargs: passed to `keras.layers.Layer`.

    Examples:
        >>> import keras, tf_diffmap
        >>> layer = tf_diffmap.testing.ReplicaDelay(0.02, replicas=[0])
        >>> model = keras.Sequential([keras.Input((4,)), layer, keras.layers.Dense(1)])
    """

    def __init__(self, seconds: float, replicas: Sequence[int] = (0,), **kwargs):
        super().__init__(**kwargs)
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, received {seconds!r}.")
        self.seconds = float(seconds)
        self.replicas = tuple(int(r) for r in replicas)

    def _sleep(self, replica_id) -> bool:
        if int(replica_id) in self.replicas:
            time.sleep(self.seconds)
        return True

    def call(self, inputs, training=None):
        if not training or not self.seconds:
            return inputs
        context = tf.distribute.get_replica_context()
        replica_id = context.replica_id_in_sync_group if context is not None else 0
        slept = tf.numpy_function(self._sleep, [replica_id], tf.bool, name="replica_delay")
        with tf.control_dependencies([slept]):
            return tf.identity(inputs)

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self) -> dict:
        return {**super().get_config(), "seconds": self.seconds, "replicas": list(self.replicas)}
