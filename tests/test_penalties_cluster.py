"""Weight regularizers on a localhost cluster: the penalty's gradient added
once per step on the ps tasks, a table split over two of them."""

import textwrap

import pytest
from cluster_chief import run_chief_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHIEF = textwrap.dedent(
    """
    import json, os, sys
    import keras, numpy as np, tensorflow as tf
    from tf_diffmap import cluster
    from tf_diffmap.store.accumulators import _Sparse
    from tf_diffmap.store.partitioned import PartitionedVariable

    ROWS, LR, L2 = 2000, 0.5, 0.05

    def make():
        return keras.Sequential([
            keras.Input((3,), dtype="int32"),
            keras.layers.Embedding(ROWS, 4, embeddings_regularizer=keras.regularizers.l2(L2),
                                   name="table"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="tanh", name="hidden",
                               kernel_regularizer=keras.regularizers.l2(L2)),
            keras.layers.Dense(2, name="out"),
        ])

    def compile(model):
        model.compile(keras.optimizers.SGD(LR),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    rng = np.random.default_rng(0)
    # Rows 48 and up are never looked up: only the penalty moves them.
    x = rng.integers(0, 48, size=(128, 3)).astype("int32")
    y = (x.sum(axis=1) % 2).astype("int32")
    # On the cluster each of the 2 workers keeps every other batch of 16
    # and cuts it in two shards of 8, and each fresh window takes one shard
    # of each worker: window 2p + h holds half h of batches 2p and 2p + 1.
    # Plain Keras trains on those windows' examples as its batches.
    order = np.arange(128).reshape(4, 2, 2, 8).transpose(0, 2, 1, 3).reshape(-1)
    plain = make()
    weights = plain.get_weights()
    compile(plain)
    plain.fit(x[order], y[order], batch_size=16, epochs=1, shuffle=False, verbose=0)
    plain_weights = plain.get_weights()  # read before the cluster's context

    report = {}
    with cluster.LocalCluster(workers=2, ps=2) as local:
        strategy = cluster.strategy_for_cluster(
            local.resolver(), max_step_staleness=int(sys.argv[1]), patience_margin=1e4,
            variable_partitioner=lambda shape, dtype: 2 if shape[0] == ROWS else 1,
        )
        with strategy.scope():
            model = make()
            model.set_weights(weights)
            compile(model)
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        (aggregation,) = strategy.extended.runtime.aggregations()
        table = model.get_layer("table").embeddings
        index = [id(v) for v in aggregation.variables].index(id(table))
        steps = int(model.optimizer.iterations.numpy())
        ours = model.get_weights()
        report.update(
            steps=steps,
            split=isinstance(table.value, PartitionedVariable),
            sparse=isinstance(aggregation.accumulators._kinds[index], _Sparse),
            penalties=len(aggregation.penalties),
            devices=sorted({s.device for s in getattr(table.value, "shards", [table.value])}),
            # Each step moves an untouched row by the penalty's gradient
            # once: it is multiplied by 1 - 2 LR L2.
            untouched_gap=float(np.abs(
                ours[0][48:] - weights[0][48:] * (1 - 2 * LR * L2) ** steps).max()),
            plain_gap=max(float(np.abs(a - b).max()) for a, b in zip(ours, plain_weights)),
        )
    print(json.dumps(report))
    os._exit(0)
    """
)


@pytest.mark.parametrize("bound", [0, 1], ids=["fresh", "bound_1"])
def test_a_regularized_table_split_over_two_ps_takes_its_penalty_once_a_step(tmp_path, bound):
    """On 2 workers and 2 ps tasks, the table split over both: the table's
    pushes are sparse, the rows no lookup touches shrink by exactly one
    penalty step per optimizer step, and with fresh windows (a patience no
    replica reaches) the weights are plain Keras' after 8 steps on the
    windows' examples."""
    report = run_chief_script(CHIEF, tmp_path, str(bound), timeout=280)
    assert report["split"] and len(report["devices"]) == 2, report
    assert all("/job:ps/" in d for d in report["devices"]), report
    assert report["sparse"] and report["penalties"] == 2, report
    assert report["steps"] >= 4, report
    assert report["untouched_gap"] < 1e-6, report
    if bound == 0:
        assert report["steps"] == 8, report
        assert report["plain_gap"] < 1e-4, report
