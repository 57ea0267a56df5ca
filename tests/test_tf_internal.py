"""The private TensorFlow APIs the strategy relies on are still there."""

import pytest
import tensorflow as tf

from tf_diffmap import _tf_internal
from tf_diffmap._tf_internal import checks as checked


def test_tensorflow_internals_match_what_the_strategy_overrides():
    assert _tf_internal.compatibility_problems() == []


def test_a_changed_hook_is_reported_by_name(monkeypatch):
    hooks = {k: v for k, v in vars(tf.compat.v1.distribute.StrategyExtended).items()}
    for base in tf.compat.v1.distribute.StrategyExtended.__mro__[1:]:
        for key, value in vars(base).items():
            hooks.setdefault(key, value)
    del hooks["_replica_ctx_update"]
    moved = type("MovedExtended", (), hooks)
    monkeypatch.setattr(checked, "ExtendedBase", moved)
    problems = _tf_internal.compatibility_problems()
    assert any("_replica_ctx_update" in p for p in problems)
    with pytest.raises(RuntimeError, match="_replica_ctx_update.*Install a TensorFlow"):
        _tf_internal.check_compatibility()


def test_a_changed_signature_is_reported(monkeypatch):
    monkeypatch.setattr(_tf_internal.ExtendedBase, "_reduce_to", lambda self, op, value: value)
    assert any("_reduce_to" in p for p in _tf_internal.compatibility_problems())


@pytest.mark.parametrize(
    "owner, name, reported",
    [
        ("resource_variable_ops", "UninitializedVariable", "UninitializedVariable is gone"),
        ("record", "record_operation", "record.record_operation is gone"),
        ("resource_variable_ops", "variable_accessed", "variable_accessed is gone"),
        ("trackable_base", "VARIABLE_VALUE_KEY", "VARIABLE_VALUE_KEY is gone"),
    ],
)
def test_what_a_split_variable_relies_on_is_checked(monkeypatch, owner, name, reported):
    monkeypatch.delattr(getattr(checked, owner), name)
    assert any(reported in p for p in _tf_internal.compatibility_problems())


def test_a_keras_variable_that_keeps_its_checkpoint_to_itself_is_reported(monkeypatch):
    import keras

    monkeypatch.setattr(keras.Variable, "_serialize_to_tensors", lambda self: {})
    problems = _tf_internal.compatibility_problems()
    assert any("keras.Variable._serialize_to_tensors no longer" in p for p in problems)
    monkeypatch.setattr(checked, "ResourceVariable", type("Bare", (), {}))
    problems = _tf_internal.compatibility_problems()
    assert any("ResourceVariable._restore_from_tensors is gone" in p for p in problems)


def test_keras_optimizers_remember_the_strategy_they_were_created_under():
    """What the outside-the-scope error reads, and the error it replaces."""
    import keras

    import tf_diffmap

    outside = keras.optimizers.SGD(0.1)
    assert _tf_internal.optimizer_strategy(outside) is tf.distribute.get_strategy()
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        assert _tf_internal.optimizer_strategy(keras.optimizers.SGD(0.1)) is strategy
        model_variable = tf.Variable(1.0)
    assert _tf_internal.optimizer_strategy(object()) is None
    # TensorFlow's own error when it makes a slot there (the base class's
    # scope: tf_diffmap's replaces this error with its own).
    with pytest.raises(RuntimeError) as raised, tf.distribute.Strategy.scope(strategy):
        outside.add_variable_from_reference(model_variable, name="momentum")
    assert _tf_internal.is_mixed_strategy_error(raised.value)
    assert not _tf_internal.is_mixed_strategy_error(RuntimeError("something else"))


def test_only_the_internal_package_imports_tensorflow_python():
    import pathlib

    internal = pathlib.Path(_tf_internal.__file__).parent
    package = internal.parent
    importers = sorted(
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "import tensorflow.python" in p.read_text() or "from tensorflow.python" in p.read_text()
    )
    assert importers and all(p.startswith("_tf_internal/") for p in importers), importers


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


PS = "/job:ps/replica:0/task:0/device:CPU:0"
WORKER = "/job:worker/replica:0/task:0/device:CPU:0"


def _run_without_devices(graph, fetches, feeds):
    """Runs `graph` in this process: the tasks its ops name do not exist here."""
    graph_def = graph.as_graph_def()
    for node in graph_def.node:
        node.device = ""
    with tf.Graph().as_default() as local:
        tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=local) as session:
            return session.run(
                [f"{t.op.name}:{t.value_index}" for t in fetches],
                {f"{t.op.name}:{t.value_index}": v for t, v in feeds.items()},
            )


def test_values_crossing_between_tasks_travel_packed_and_unchanged():
    import numpy as np

    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            kernel = tf.compat.v1.placeholder(tf.float32, [3, 2], name="kernel")
            bias = tf.compat.v1.placeholder(tf.float32, [2], name="bias")
            steps = tf.compat.v1.placeholder(tf.int64, [], name="steps")  # not floating
            kernel_read, bias_read = tf.identity(kernel), tf.identity(bias)
        with tf.device(WORKER):
            x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
            logits = tf.matmul(x, kernel_read) + bias_read
            loss = tf.reduce_sum(logits * logits)
            # The gradients of the loss, written out (tf.gradients colocates
            # its ops with the forward ones, as a GradientTape does not).
            kernel_grad = 2.0 * tf.matmul(x, logits, transpose_a=True)
            bias_grad = 2.0 * tf.reduce_sum(logits, axis=0)
            counted = steps + 1
        with tf.device(PS):
            new_kernel = kernel_read - 0.1 * kernel_grad
            new_bias = bias_read - 0.1 * bias_grad
            counted_there = counted * 2
    before = {op.name for op in graph.get_operations()}
    rng = np.random.default_rng(0)
    feeds = {
        kernel: rng.normal(size=(3, 2)).astype("float32"),
        bias: rng.normal(size=2).astype("float32"),
        steps: 4,
        x: rng.normal(size=(4, 3)).astype("float32"),
    }
    fetches = [new_kernel, new_bias, counted_there, loss]
    expected = _run_without_devices(graph, fetches, feeds)

    # Two parameters to the worker, two gradients back; the int64 goes alone.
    assert _tf_internal.pack_crossings(graph) == 4
    packed = [op for op in graph.get_operations() if op.name not in before]
    assert all(op.name.startswith(_tf_internal.PACKED_SCOPE) for op in packed)
    joins = {op.device: op for op in packed if op.type == "ConcatV2"}
    splits = {op.device: op for op in packed if op.type in ("Split", "SplitV")}
    assert len([op for op in packed if op.type == "ConcatV2"]) == 2
    assert set(joins) == set(splits) == {PS, WORKER}
    # Every op across the tasks from what it uses now takes a piece of a pack.
    for op in graph.get_operations():
        if op.name in before and op.device:
            for tensor in op.inputs:
                crosses = tensor.op.device and tensor.op.device != op.device
                if crosses and tensor.dtype == tf.float32:
                    assert tensor.op.name.startswith(_tf_internal.PACKED_SCOPE), op.name
    assert counted.op.inputs[0] is steps
    actual = _run_without_devices(graph, fetches, feeds)
    for want, got in zip(expected, actual):
        np.testing.assert_array_equal(got, want)  # bit for bit


def test_a_value_that_waits_for_its_packs_consumers_is_not_packed():
    """Packing b with a would make b wait for itself: b is computed on the ps
    from what the worker made of a."""
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            a = tf.compat.v1.placeholder(tf.float32, [2], name="a")
            d = tf.compat.v1.placeholder(tf.float32, [3], name="d")
            a_there, d_there = tf.identity(a), tf.identity(d)
        with tf.device(WORKER):
            a_used = a_there * 2.0
        with tf.device(PS):
            b = a_used + 1.0  # depends on the worker's use of a
            with tf.control_dependencies([a_used]):
                c = tf.identity(d_there)  # waits for it, by a control edge
        with tf.device(WORKER):
            b_used = b * 3.0
            out = b_used + tf.reduce_sum(d_there) + tf.reduce_sum(c)
    assert _tf_internal.pack_crossings(graph) == 2  # a and d; neither b nor c
    assert b_used.op.inputs[0] is b
    assert not c.op.name.startswith(_tf_internal.PACKED_SCOPE)
    (value,) = _run_without_devices(graph, [out], {a: [1.0, 2.0], d: [1.0, 1.0, 1.0]})
    assert list(value) == [15.0, 21.0]


def test_a_value_too_large_to_gain_travels_alone():
    rows = _tf_internal.PACK_MAX_BYTES // (4 * 64) + 1  # just over the limit in float32
    graph = tf.Graph()
    with graph.as_default():
        with tf.device(PS):
            large = tf.identity(tf.compat.v1.placeholder(tf.float32, [rows, 64]))
            small = [tf.identity(tf.compat.v1.placeholder(tf.float32, [8])) for _ in range(2)]
        with tf.device(WORKER):
            used = [tf.reduce_sum(large) + tf.reduce_sum(s) for s in small]
    assert _tf_internal.pack_crossings(graph) == 2
    assert used[0].op.inputs[0].op.inputs[0] is large


def test_a_dataset_s_traced_functions_are_found_through_its_inputs():
    """What keeps a replaced input's functions registered on a cluster
    while a worker is lost (`dataset_functions`, private `tf.data` API)."""
    dataset = tf.data.Dataset.range(8).map(lambda x: x * 2).filter(lambda x: x > 2).batch(2)
    functions = _tf_internal.dataset_functions(dataset)
    assert len(functions) == 2  # the map's and the filter's, found through `batch`
    assert all(isinstance(f, tf.types.experimental.ConcreteFunction) for f in functions)
    assert _tf_internal.dataset_functions(tf.data.Dataset.range(3)) == []
