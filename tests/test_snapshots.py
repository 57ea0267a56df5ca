"""The ring of counter snapshots that Keras' graph takes at each step."""

import keras
import numpy as np

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.store.snapshots import CounterSnapshots


def small_ring_model(capacity):
    strategy = tf_diffmap.Strategy()
    extended = strategy.extended
    # Before the first step is traced, so that Keras' graph writes this ring.
    extended.runtime.snapshots = CounterSnapshots(
        extended.runtime.store, extended.runtime.client_host, capacity
    )
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(0.05))
    return strategy, model


def test_a_reader_that_keeps_up_sees_every_step_in_order():
    x, y = classification_data(n=10 * 32)
    strategy, model = small_ring_model(capacity=64)
    ring = strategy.extended.runtime.snapshots
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # traced, ring off
    assert ring.read(0).next_index == 0, "a ring switched off takes no snapshot"

    reader = object()
    start = ring.start(reader)
    version_before = strategy.statistics().version
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    ring.stop(reader)
    read = ring.read(start)
    assert read.lost == 0
    np.testing.assert_array_equal(read.indices, np.arange(start, start + 10))
    assert read.next_index == start + 10
    # Taken after each step's shards were queued: the version never goes
    # back, and the snapshots end at most the updates in flight behind.
    assert (np.diff(read.versions) >= 0).all() and (np.diff(read.times) >= 0).all()
    assert version_before < read.versions[-1] <= strategy.statistics().version
    for k in range(len(read)):
        counters = read.counters[k]
        assert counters.shape == strategy.extended.runtime.store.counters.shape
        assert read.stats(k, strategy.statistics()).updates.sum() <= read.versions[k]
    # Off again: another fit adds nothing.
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert ring.read(read.next_index).next_index == read.next_index


def test_a_reader_lapped_by_the_ring_is_told_what_it_lost():
    x, y = classification_data(n=10 * 32)
    strategy, model = small_ring_model(capacity=4)
    ring = strategy.extended.runtime.snapshots
    start = ring.start(object())
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    read = ring.read(start)
    assert read.lost == 6 and len(read) == 4
    np.testing.assert_array_equal(read.indices, np.arange(start + 6, start + 10))
    assert (np.diff(read.versions) >= 0).all()


def test_the_ring_is_on_while_a_reader_is_registered():
    strategy = tf_diffmap.Strategy()
    ring = strategy.extended.runtime.snapshots
    first, second = object(), object()
    ring.start(first)
    ring.start(second)
    ring.stop(first)
    assert ring.on.numpy()
    ring.stop(second)
    assert not ring.on.numpy()
    ring.start(first)
    ring.stop()  # every reader, as a failing fit does
    assert not ring.on.numpy()
