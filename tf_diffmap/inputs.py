"""Input pipelines under the strategy.

The strategy feeds whole host batches to its dispatch op, which splits them
into one shard per update. So a dataset is not distributed over devices at
all: `HostDataset` iterates the user's `tf.data.Dataset` on the host, from
Python, which gives the strategy a point of contact with the caller's thread
at every step (to raise a replica's error there, and to hold the caller back
while the shard queue is full) without rebuilding a multi-device iterator
every epoch.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

__all__ = ["HostDataset", "HostIterator"]


class HostIterator:
    """Iterates host batches; raises a replica's error promptly.

    At the end of the data it raises `tf.errors.OutOfRangeError`, as a
    distributed iterator's `get_next()` does, which is what Keras' training
    loop expects from an iterator it drives from Python.
    """

    def __init__(self, dataset: tf.data.Dataset, before_next: Callable[[], None]):
        self._iterator = iter(dataset)
        self._before_next = before_next
        self.element_spec = dataset.element_spec

    def __iter__(self):
        return self

    def __next__(self):
        self._before_next()
        try:
            return next(self._iterator)
        except StopIteration:
            raise tf.errors.OutOfRangeError(None, None, "End of sequence") from None

    def get_next(self):
        return next(self)


class HostDataset:
    """A `tf.data.Dataset` as the strategy sees it: whole batches on the host."""

    def __init__(self, dataset: tf.data.Dataset, before_next: Callable[[], None]):
        if not isinstance(dataset, tf.data.Dataset):
            raise ValueError(
                "tf_diffmap.Strategy distributes tf.data.Dataset objects, "
                f"received {type(dataset).__name__}. Wrap arrays with "
                "tf.data.Dataset.from_tensor_slices(...).batch(n) or pass them "
                "to model.fit directly."
            )
        self.dataset = dataset
        self._before_next = before_next

    @property
    def element_spec(self):
        return self.dataset.element_spec

    def __iter__(self) -> HostIterator:
        return HostIterator(self.dataset, self._before_next)
