"""The private TensorFlow APIs the strategy relies on are still there."""

import pytest
import tensorflow as tf

from tf_diffmap import _tf_internal


def test_tensorflow_internals_match_what_the_strategy_overrides():
    assert _tf_internal.compatibility_problems() == []


def test_a_changed_hook_is_reported_by_name(monkeypatch):
    hooks = {k: v for k, v in vars(tf.compat.v1.distribute.StrategyExtended).items()}
    for base in tf.compat.v1.distribute.StrategyExtended.__mro__[1:]:
        for key, value in vars(base).items():
            hooks.setdefault(key, value)
    del hooks["_replica_ctx_update"]
    moved = type("MovedExtended", (), hooks)
    monkeypatch.setattr(_tf_internal, "ExtendedBase", moved)
    problems = _tf_internal.compatibility_problems()
    assert any("_replica_ctx_update" in p for p in problems)
    with pytest.raises(RuntimeError, match="_replica_ctx_update.*Install a TensorFlow"):
        _tf_internal.check_compatibility()


def test_a_changed_signature_is_reported(monkeypatch):
    monkeypatch.setattr(_tf_internal.ExtendedBase, "_reduce_to", lambda self, op, value: value)
    assert any("_reduce_to" in p for p in _tf_internal.compatibility_problems())


def test_only_one_module_imports_tensorflow_python():
    import pathlib

    package = pathlib.Path(_tf_internal.__file__).parent
    importers = sorted(
        p.name
        for p in package.glob("*.py")
        if "tensorflow.python" in p.read_text()
        and (
            "import tensorflow.python" in p.read_text() or "from tensorflow.python" in p.read_text()
        )
    )
    assert importers == ["_tf_internal.py"]


def test_store_variable_rewrites_keras_assign_add_as_atomic_add():
    variable = _tf_internal.StoreVariable.adopt(tf.Variable(1.0), lambda: None)
    tracing = _tf_internal.replica_tracing()

    @tf.function
    def step():
        tracing.active = True
        try:
            variable.assign(variable + 2.0)
        finally:
            tracing.active = False

    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert "AssignAddVariableOp" in types
    assert "AssignVariableOp" not in types
    step()
    assert variable.numpy() == 3.0


def test_scalar_bookkeeping_runs_beside_the_variables_it_reads():
    """A step traced on CPU:1: what it computes from CPU:0's variables alone
    (scalars) moves to CPU:0; what touches its own data stays."""
    with tf.device("CPU:0"):
        total = tf.Variable(6.0)
        count = tf.Variable(3.0)
        steps = tf.Variable(tf.constant(0, tf.int64))
        kernel = tf.Variable(tf.ones([2, 2]))
    moved = {}

    @tf.function(autograph=False)
    def step(x):
        with tf.device("CPU:1"):
            mean = tf.math.divide_no_nan(total.read_value(), count.read_value())
            steps.assign_add(tf.cast(tf.constant(1), tf.int64))
            doubled = kernel.read_value() * 2.0  # not a scalar
            loss = tf.reduce_sum(x) * mean  # mixes the shard in
            moved["ops"] = _tf_internal.place_scalars_beside_reads(
                tf.compat.v1.get_default_graph(), "/job:localhost/replica:0/task:0/device:CPU:1"
            )
        return mean, doubled, loss

    graph = step.get_concrete_function(tf.TensorSpec([2], tf.float32)).graph
    device = {op.name: tf.DeviceSpec.from_string(op.device) for op in graph.get_operations()}
    by_type = {op.type: op.name for op in graph.get_operations()}
    assert device[by_type["DivNoNan"]].device_index == 0
    assert device[by_type["Cast"]].device_index == 0  # the constant added to a counter
    assert device[by_type["Mul"]].device_index == 1
    assert device[by_type["Sum"]].device_index == 1
    assert moved["ops"] >= 3  # the division, the cast and its constant
    mean, doubled, loss = step(tf.constant([1.0, 2.0]))
    assert float(mean) == 2.0 and float(loss) == 6.0 and int(steps.numpy()) == 1
