"""Aggregation on a localhost cluster: windows beside the variables on the ps,
and a worker killed in the middle of a step.
"""

import textwrap

import pytest
from cluster_chief import run_chief_script

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CHIEF = textwrap.dedent(
    """
    import json, os, sys, threading
    import keras, numpy as np, tensorflow as tf
    from tf_diffmap import cluster

    LR = 0.125
    report = {}
    with cluster.LocalCluster(workers=2, ps=1) as local:
        strategy = cluster.strategy_for_cluster(
            local.resolver(), max_step_staleness=int(sys.argv[1])
        )
        with strategy.scope():
            # With inputs of ones, the summed output's gradient is 1 per
            # weight: every step of the optimizer moves each weight by LR.
            dense = keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros")
            model = keras.Sequential([keras.Input((4,)), dense])
            model.compile(optimizer=keras.optimizers.SGD(LR),
                          loss=lambda y, p: tf.reduce_sum(p, axis=-1))
        runtime = strategy.extended.runtime
        (store_host,) = {runtime.store.host}

        class Kill(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch == 10 and local.is_running("worker", 1):
                    report["steps_at_kill"] = int(runtime.store.optimizer_steps.numpy())
                    # From another thread, while the loops push shards.
                    threading.Timer(0.05, local.kill, ("worker", 1)).start()

        x, y = np.ones((2048, 4), "float32"), np.zeros((2048, 3), "float32")
        model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[Kill()])
        stats = strategy.statistics()
        (aggregation,) = runtime.aggregations()
        report.update(
            steps=stats.steps,
            iterations=int(model.optimizer.iterations.numpy()),
            pending=aggregation.pending(),
            weights=model.get_weights()[0].tolist(),
            version=strategy.version,
            abandoned=stats.abandoned,
            states=[r.state for r in strategy.replica_states()],
            accumulator_devices=sorted(
                {k.accumulator.device for k in aggregation.accumulators._kinds.values()}
            ),
            variable_device=model.weights[0].value.device,
            store_host=store_host,
        )
    print(json.dumps(report))
    os._exit(0)
    """
)


@pytest.mark.parametrize("bound", [1, 0], ids=["bound_1", "fresh"])
def test_a_worker_killed_mid_step_leaves_every_window_whole(tmp_path, bound):
    """No accepted gradient is lost and none counts twice: with a constant
    gradient each step moves each weight by exactly LR, so a window that
    held a part of a push cut off (or lost one of its pushes' gradients
    while counting it) would move it by another amount. Training goes on
    past the loss, and the mutex a killed push may have held is released.
    With fresh windows, the windows the lost worker's replica would have
    pushed into close short once their patience runs out."""
    report = run_chief_script(CHIEF, tmp_path, str(bound), timeout=280)
    assert report["states"][1] == "lost", report
    assert report["steps"] == report["iterations"]
    assert report["pending"] == 0
    # Steps went on long after the kill: one per batch of the two epochs left.
    assert report["steps"] - report["steps_at_kill"] >= 2 * 64
    # Each step moved each weight by LR (0.125, so the sum is exact).
    assert report["weights"] == [[-0.125 * report["steps"]] * 3] * 4, report
    # The accumulators live beside the variable, on the ps.
    assert report["accumulator_devices"] == [report["variable_device"]]
    assert "/job:ps/" in report["variable_device"]
