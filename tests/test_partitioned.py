"""Large tables split by rows over the parameter devices (one host: two
logical CPU devices stand for two ps tasks; the cluster test is slow)."""

import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tests.test_sparse import (
    IDS,
    bag_of_ids,
    id_data,
    live_ops,
    replica_step_graph,
    table_sized,
    tied_model,
)
from tests.test_sparse import OPTIMIZERS as SPARSE_OPTIMIZERS
from tf_diffmap import _tf_internal
from tf_diffmap.store.partitioned import (
    PartitionedVariable,
    RowPartitioner,
    RowSplit,
    resolve_partitioner,
    shards_for,
)

PS = ["CPU:2", "CPU:3"]
SPLIT = lambda shape, dtype: 2  # noqa: E731  (every variable with rows, in two)
# The one-replica comparisons: each optimizer and rule of the row updates.
OPTIMIZERS = {
    name: make
    for name, make in SPARSE_OPTIMIZERS.items()
    if name in ("sgd", "momentum", "adagrad", "adam", "ftrl", "gap", "dc")
}


def table_of(model) -> tf.Variable:
    return model.layers[0].embeddings.value


def one_replica(rows, optimizer, partitioner, seed=5, **compile_kwargs):
    keras.utils.set_random_seed(seed)
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0"], parameter_device=PS, variable_partitioner=partitioner
    )
    with strategy.scope():
        model = bag_of_ids(rows)
        model.compile(optimizer=OPTIMIZERS[optimizer](), loss="mse", **compile_kwargs)
    return strategy, model


def test_a_table_and_its_slots_are_split_over_the_parameter_devices():
    rows = 40_000  # 1.25 MiB of float32: shards of 256 KiB at least, one per device
    strategy = tf_diffmap.Strategy(parameter_device=PS, variable_partitioner=RowPartitioner())
    with strategy.scope():
        model = bag_of_ids(rows)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(*id_data(rows), batch_size=128, epochs=1, verbose=0)
    table = table_of(model)
    assert isinstance(table, PartitionedVariable)
    assert model.layers[0].embeddings.shape == (rows, 8)
    devices = [shard.device for shard in table.shards]
    assert [d.rsplit("/", 1)[1] for d in devices] == ["device:CPU:2", "device:CPU:3"]
    assert [shard.shape.as_list() for shard in table.shards] == [[rows // 2, 8]] * 2
    whole = model.get_weights()[0]
    np.testing.assert_array_equal(table.shards[0].numpy(), whole[: rows // 2])
    np.testing.assert_array_equal(table.shards[1].numpy(), whole[rows // 2 :])
    # Adam's moments are split alike, each shard beside the table's.
    slots = _tf_internal.optimizer_slots(model.optimizer, table)
    for slot in slots.values():
        assert [s.device for s in slot.shards] == devices
    # The small layer is not split, and the store counts the shards' bytes.
    assert not isinstance(model.layers[-1].kernel.value, PartitionedVariable)
    held = strategy.extended.runtime.store.bytes_per_device()
    assert all(held[d] >= 3 * rows // 2 * 8 * 4 for d in strategy.parameter_devices)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_split_table_trains_as_the_whole_one_with_one_replica(optimizer):
    rows = 512
    x, y = id_data(rows, n=256, seed=2)
    tables = {}
    for partitioner in (None, SPLIT):
        _, model = one_replica(rows, optimizer, partitioner)
        assert isinstance(table_of(model), PartitionedVariable) == bool(partitioner)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        tables[partitioner] = model.get_weights()
    for split, whole in zip(tables[SPLIT], tables[None]):
        np.testing.assert_allclose(split, whole, rtol=1e-6, atol=1e-7)
    assert not np.allclose(tables[SPLIT][0], bag_of_ids_initial(rows))


def bag_of_ids_initial(rows):
    keras.utils.set_random_seed(5)
    return bag_of_ids(rows).get_weights()[0]


def test_a_split_table_trains_as_keras_with_sgd_eagerly_too():
    rows = 512
    x, y = id_data(rows, n=256, seed=2)
    keras.utils.set_random_seed(5)
    plain = bag_of_ids(rows)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    _, model = one_replica(rows, "sgd", SPLIT, run_eagerly=True)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    for split, expected in zip(model.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(split, expected, rtol=1e-5, atol=1e-6)


def test_a_split_table_also_used_whole_is_read_whole_and_trains():
    """Tied embeddings: the table is looked up and multiplied by."""
    rows, width = 1_024, 16
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x = np.random.default_rng(1).integers(0, rows, (128, IDS)).astype("int32")
    keras.utils.set_random_seed(3)
    plain = tied_model(rows, width)
    plain.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    keras.utils.set_random_seed(3)
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0"], parameter_device=PS, variable_partitioner=SPLIT
    )
    with strategy.scope():
        model = tied_model(rows, width)
        model.compile(optimizer=keras.optimizers.SGD(1.0), loss=loss)
    for m in (plain, model):
        m.fit(x, x[:, :1], batch_size=32, epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(model.get_weights()[0], plain.get_weights()[0], atol=1e-5)


def test_an_update_reads_and_writes_rows_beside_each_shard():
    rows = 200_000
    strategy = tf_diffmap.Strategy(parameter_device=PS, variable_partitioner=RowPartitioner())
    with strategy.scope():
        model = bag_of_ids(rows)
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(*id_data(rows), batch_size=128, epochs=1, verbose=0)
    ops = live_ops(replica_step_graph(strategy))
    # Nothing of the table's size, nor of a shard's, runs at an update.
    assert table_sized(ops, rows) == []
    assert table_sized(ops, rows // 2) == []
    devices = {shard.device for shard in table_of(model).shards}
    for kind in ("ResourceGather", "ResourceScatterNdAdd", "ResourceScatterNdSub"):
        assert {op.device for op in ops if op.type == kind} >= devices, kind
    # The ids are split by shard, and the rows put back, where the replica runs.
    for kind in ("DynamicPartition", "DynamicStitch"):
        assert {op.device for op in ops if op.type == kind} <= {
            strategy.extended.runtime.compute_devices[0]
        }


def test_a_split_variable_reads_gathers_and_scatters_by_row():
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0"], parameter_device=PS, variable_partitioner=SPLIT
    )
    initial = np.arange(15, dtype="float32").reshape(5, 3)
    with strategy.scope():
        variable = tf.Variable(initial)
    assert [s.shape.as_list() for s in variable.shards] == [[3, 3], [2, 3]]
    np.testing.assert_array_equal(variable.numpy(), initial)
    ids = tf.constant([[4, 0], [2, 4]])
    np.testing.assert_array_equal(tf.gather(variable, ids).numpy(), initial[[[4, 0], [2, 4]]])
    traced = tf.function(lambda i: tf.gather(variable, i))
    np.testing.assert_array_equal(traced(ids).numpy(), initial[[[4, 0], [2, 4]]])
    with tf.GradientTape() as tape:
        looked_up = tf.reduce_sum(variable.sparse_read([1, 3, 3]))
    gradient = tape.gradient(looked_up, variable)
    assert isinstance(gradient, tf.IndexedSlices)
    assert sorted(gradient.indices.numpy().tolist()) == [1, 3, 3]
    with tf.GradientTape() as tape:
        whole = tf.reduce_sum(variable * 2.0)
    np.testing.assert_array_equal(tape.gradient(whole, variable), np.full((5, 3), 2.0))
    variable.scatter_add(tf.IndexedSlices(tf.ones((3, 3)), tf.constant([0, 4, 4])))
    variable.scatter_update(tf.IndexedSlices(tf.zeros((1, 3)), tf.constant([2])))
    expected = initial.copy()
    expected[0] += 1
    expected[4] += 2
    expected[2] = 0
    np.testing.assert_array_equal(variable.numpy(), expected)
    variable.assign_add(np.ones((5, 3), "float32"))
    np.testing.assert_array_equal(variable.shards[1].numpy(), expected[3:] + 1)
    with pytest.raises(ValueError, match="shape"):
        variable.assign(np.ones((4, 3), "float32"))
    with pytest.raises(NotImplementedError, match="split by rows"):
        variable.scatter_nd_add([[0, 0]], [1.0])


@pytest.mark.slow  # a process of its own
def test_keras_file_loads_as_one_table_without_the_package(tmp_path):
    rows = 1_000
    _, model = one_replica(rows, "adam", SPLIT)
    model.fit(*id_data(rows, n=128), batch_size=32, epochs=1, verbose=0)
    path = tmp_path / "split.keras"
    model.save(path)
    np.save(tmp_path / "table.npy", model.get_weights()[0])
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, keras
        model = keras.models.load_model({str(path)!r})
        table = model.layers[0].embeddings
        assert type(table.value).__name__ == "ResourceVariable", type(table.value)
        np.testing.assert_array_equal(table.numpy(), np.load({str(tmp_path / "table.npy")!r}))
        assert "tf_diffmap" not in sys.modules
        print("one table", table.shape)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"one table ({rows}, 8)" in result.stdout


def test_checkpoint_holds_one_table_and_restores_across_splits(tmp_path):
    rows = 1_000
    _, model = one_replica(rows, "adam", SPLIT)
    model.fit(*id_data(rows, n=128), batch_size=32, epochs=1, verbose=0)
    saved = tf.train.Checkpoint(model=model).save(str(tmp_path / "split" / "ckpt"))
    tables = [(name, shape) for name, shape in tf.train.list_variables(saved) if rows in shape]
    # The table and Adam's two moments, each under one name, whole.
    assert len(tables) == 3 and all(shape == [rows, 8] for _, shape in tables), tables
    assert not [name for name, _ in tf.train.list_variables(saved) if "part_" in name]
    plain = bag_of_ids(rows)
    tf.train.Checkpoint(model=plain).restore(saved).expect_partial()
    np.testing.assert_array_equal(plain.get_weights()[0], model.get_weights()[0])
    # And the other way: a plain model's checkpoint into a split one.
    plain.layers[0].embeddings.assign(np.full((rows, 8), 0.25, "float32"))
    saved_plain = tf.train.Checkpoint(model=plain).save(str(tmp_path / "plain" / "ckpt"))
    _, again = one_replica(rows, "adam", SPLIT, seed=9)
    tf.train.Checkpoint(model=again).restore(saved_plain).expect_partial()
    assert all((shard.numpy() == 0.25).all() for shard in table_of(again).shards)


def test_backup_and_restore_resumes_a_split_model(tmp_path):
    rows = 1_000
    x, y = id_data(rows, n=128)

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    _, model = one_replica(rows, "adam", SPLIT)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x,
            y,
            batch_size=32,
            epochs=4,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup), Interrupt()],
        )
    saved = model.get_weights()[0]

    class Peek(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.table = self.model.get_weights()[0]

    _, resumed = one_replica(rows, "adam", SPLIT, seed=9)
    peek = Peek()
    history = resumed.fit(
        x,
        y,
        batch_size=32,
        epochs=4,
        verbose=0,
        callbacks=[keras.callbacks.BackupAndRestore(backup), peek],
    )
    assert history.epoch == [2, 3]
    np.testing.assert_array_equal(peek.table, saved)
    assert isinstance(table_of(resumed), PartitionedVariable)


def test_partitioners_decide_the_shards_within_the_devices_and_rows():
    shape, f32 = tf.TensorShape([100_000, 16]), tf.float32
    assert RowPartitioner()(shape, f32) == 24
    assert RowPartitioner(max_shards=3)(shape, f32) == 3
    assert shards_for(RowPartitioner(), shape, f32, devices=2, name="t") == 2
    assert shards_for(RowPartitioner(), [1_000, 16], f32, devices=2, name="t") == 1
    assert shards_for(None, shape, f32, devices=2, name="t") == 1
    assert shards_for(SPLIT, [3], f32, devices=1, name="t") == 1
    assert shards_for(SPLIT, [], f32, devices=2, name="t") == 1
    assert shards_for(lambda s, d: 8, [3, 2], f32, devices=4, name="t") == 3
    # tf.distribute's partitioners answer per axis.
    tf_partitioner = tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1 << 10, max_shards=4
    )
    assert shards_for(tf_partitioner, shape, f32, devices=2, name="t") == 2
    assert RowSplit.even(5, 2).sizes == (3, 2) and RowSplit.even(5, 2).offsets == (0, 3, 5)
    # "auto": split only when the parameter devices are on several tasks.
    ps = [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in (0, 1)]
    assert isinstance(resolve_partitioner("auto", ps), RowPartitioner)
    assert resolve_partitioner("auto", ps[:1]) is None
    assert resolve_partitioner("auto", ["/device:CPU:0", "/device:CPU:1"]) is None


def test_a_tf_distribute_partitioner_splits_a_table():
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0"],
        parameter_device=PS,
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    assert tf_diffmap.Strategy(parameter_device=PS).variable_partitioner is None
    with strategy.scope():
        variable = tf.Variable(tf.zeros([10, 2]))
    assert [s.shape[0] for s in variable.shards] == [5, 5]


@pytest.mark.parametrize(
    "partitioner, message",
    [
        ("rows", "must be 'auto', None, or a callable"),
        (2, "must be 'auto', None, or a callable"),
        (lambda: 2, "cannot be called so"),
    ],
)
def test_a_bad_partitioner_is_refused_when_the_strategy_is_built(partitioner, message):
    with pytest.raises(ValueError, match=message):
        tf_diffmap.Strategy(parameter_device=PS, variable_partitioner=partitioner)


@pytest.mark.parametrize("answer", [0, "two", 2.0, [2, 2], [2]])
def test_a_bad_number_of_shards_names_the_variable(answer):
    strategy = tf_diffmap.Strategy(
        devices=["CPU:0"], parameter_device=PS, variable_partitioner=lambda shape, dtype: answer
    )
    with (
        pytest.raises(ValueError, match=r"returned .* for variable 'lookup' of shape \[4, 2\]"),
        strategy.scope(),
    ):
        tf.Variable(tf.zeros([4, 2]), name="lookup")


def test_bad_row_partitioner_arguments():
    with pytest.raises(ValueError, match="min_shard_bytes must be an int >= 1"):
        RowPartitioner(min_shard_bytes=0)
    with pytest.raises(ValueError, match="max_shards must be None or an int >= 1"):
        RowPartitioner(max_shards=True)


CLUSTER_CLIENT = textwrap.dedent(
    """
    import json, os, tempfile
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import keras, numpy as np, tensorflow as tf
    from tf_diffmap import _tf_internal, cluster
    from tf_diffmap.store.partitioned import PartitionedVariable

    IDS, ROWS = 16, 40_000  # a table of 1.25 MiB: one shard per ps task
    rng = np.random.default_rng(0)
    # 512 ids spread over the table (both shards), each seen 32 times an
    # epoch: a target the table can learn in three epochs.
    ids = rng.choice(ROWS, 512, replace=False)
    x = ids[rng.integers(0, len(ids), (1024, IDS))].astype("int32")
    y = rng.normal(size=ROWS).astype("float32")[x].mean(axis=1, keepdims=True)
    out = tempfile.mkdtemp()
    with cluster.LocalCluster(workers=2, ps=2) as local:
        strategy = cluster.strategy_for_cluster(local.resolver())
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((IDS,), dtype="int32"), keras.layers.Embedding(ROWS, 8),
                keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1),
            ])
            model.compile(optimizer=keras.optimizers.Adagrad(0.5), loss="mse")
        before = model.evaluate(x, y, verbose=0)

        class Interrupt(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 1:
                    raise RuntimeError("interrupted")

        backup = keras.callbacks.BackupAndRestore(os.path.join(out, "backup"))
        try:
            model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[backup, Interrupt()])
        except RuntimeError:
            pass
        resumed = model.fit(x, y, batch_size=64, epochs=3, verbose=0, callbacks=[backup])
        after = model.evaluate(x, y, verbose=0)
        table = model.layers[0].embeddings.value
        whole = model.get_weights()[0]
        slots = _tf_internal.optimizer_slots(model.optimizer, table)
        (program,) = strategy.extended.runtime.feeds()
        graph = next(iter(program.step.concretes.values())).graph
        saved = tf.train.Checkpoint(model=model).save(os.path.join(out, "ckpt"))
        model.save(os.path.join(out, "split.keras"))
        report = {
            "split": isinstance(table, PartitionedVariable),
            "shards": [[s.device, s.shape.as_list()] for s in table.shards],
            "slot_shards": [s.device for slot in slots.values() for s in slot.shards],
            "halves": bool(np.array_equal(
                np.concatenate([s.numpy() for s in table.shards]), whole)),
            "gathers": sorted({op.device for op in graph.get_operations()
                               if op.type == "ResourceGather"}),
            "version": strategy.version,
            "before": before, "after": after, "resumed_epochs": resumed.epoch,
            "checkpoint": [shape for _, shape in tf.train.list_variables(saved)
                           if ROWS in shape],
        }
    reloaded = keras.models.load_model(os.path.join(out, "split.keras"))
    report["reloaded"] = bool(np.array_equal(reloaded.get_weights()[0], whole))
    print(json.dumps(report))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_table_is_split_over_the_ps_tasks_of_a_cluster(tmp_path):
    from tests.test_cluster import run_chief

    report = run_chief(CLUSTER_CLIENT, tmp_path)
    ps = [f"/job:ps/replica:0/task:{t}/device:CPU:0" for t in (0, 1)]
    assert report["split"]
    assert report["shards"] == [[ps[0], [20_000, 8]], [ps[1], [20_000, 8]]]
    assert report["slot_shards"] == ps  # Adagrad's accumulator, beside the table's rows
    assert report["halves"] and report["reloaded"]
    assert set(report["gathers"]) >= set(ps)
    assert report["resumed_epochs"] == [2]  # BackupAndRestore resumed after epoch 1
    assert report["version"] == 3 * 1024 // 64 * 2
    assert report["after"] < report["before"], (report["before"], report["after"])
    assert report["checkpoint"] == [[40_000, 8]] * 2  # the table and its accumulator


def test_a_saved_model_export_says_how_to_export_a_split_table(tmp_path):
    _, model = one_replica(1_000, "sgd", SPLIT)
    with pytest.raises(NotImplementedError, match=r"model.save\('model.keras'\)"):
        model.export(str(tmp_path / "exported"))


@pytest.mark.parametrize("per_step", [1, "auto"], ids=["per_shard", "aggregated"])
def test_no_row_increment_is_lost_on_either_shard_with_four_replicas(per_step):
    """Every example looks up rows 0..15 of 24, on both shards; each update
    (or aggregated step) subtracts exactly, as in tests/test_sparse.py."""
    rows, lr = 24, 0.125
    strategy = tf_diffmap.Strategy(
        parameter_device=PS, variable_partitioner=SPLIT, gradients_per_step=per_step
    )
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IDS,), dtype="int32"),
                keras.layers.Embedding(rows, 4, embeddings_initializer="zeros"),
            ]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(lr),
            loss=lambda y_true, y_pred: tf.reduce_sum(y_pred, axis=[1, 2]),
        )
    assert [s.shape[0] for s in table_of(model).shards] == [12, 12]
    x = np.tile(np.arange(IDS, dtype="int32"), (1024, 1))
    model.fit(x, np.zeros((1024, IDS, 4), "float32"), batch_size=64, epochs=2, verbose=0)
    updates = strategy.version
    assert updates == 2 * (1024 // 64) * 4
    steps = updates if per_step == 1 else strategy.statistics().steps
    if per_step != 1:
        # Fresh windows: one step per window of a batch's examples, where a
        # late shard (dropped, its examples skipped) may leave a window short.
        windows = strategy.window_statistics()
        assert steps == windows.windows > 0
        assert windows.examples + windows.skipped == 2 * 1024
    table = model.get_weights()[0]
    np.testing.assert_array_equal(table[:IDS], np.full((IDS, 4), -steps * lr, "float32"))
    np.testing.assert_array_equal(table[IDS:], 0.0)
