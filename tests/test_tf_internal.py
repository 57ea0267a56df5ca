"""TensorFlow's and Keras' private APIs that tf_diffmap relies on, exercised.

`_tf_internal.check_compatibility` looks every hook and member up by name.
These tests go further: each hook the strategy overrides is run through
TensorFlow or Keras the way training runs it, with a recorder around it, and
each test asserts that TensorFlow routed through the hook (a release that
renames a hook or stops calling it fails the test named after it); each
rewrite of a traced graph is applied and its effect asserted.
"""

import collections
import contextlib
import functools
import pathlib
import sys
import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_diffmap
from tf_diffmap import _tf_internal
from tf_diffmap import extended as extended_module
from tf_diffmap._tf_internal import checks

Extended = extended_module.AsyncExtended

# -- what `check_compatibility` looks up ---------------------------------------


def test_tensorflow_internals_match_what_the_strategy_overrides():
    assert _tf_internal.compatibility_problems() == []


def test_a_changed_hook_is_reported_by_name(monkeypatch):
    hooks = {k: v for k, v in vars(tf.compat.v1.distribute.StrategyExtended).items()}
    for base in tf.compat.v1.distribute.StrategyExtended.__mro__[1:]:
        for key, value in vars(base).items():
            hooks.setdefault(key, value)
    del hooks["_replica_ctx_update"]
    moved = type("MovedExtended", (), hooks)
    monkeypatch.setattr(checks, "ExtendedBase", moved)
    problems = _tf_internal.compatibility_problems()
    assert any("_replica_ctx_update" in p for p in problems)
    with pytest.raises(RuntimeError, match="_replica_ctx_update.*Install a TensorFlow"):
        _tf_internal.check_compatibility()


def test_a_changed_signature_is_reported(monkeypatch):
    monkeypatch.setattr(_tf_internal.ExtendedBase, "_reduce_to", lambda self, op, value: value)
    assert any("_reduce_to" in p for p in _tf_internal.compatibility_problems())


def test_a_hook_no_tensorflow_strategy_defines_any_more_is_reported(monkeypatch):
    monkeypatch.setattr(checks, "_built_in_extended_classes", lambda: [])
    problems = _tf_internal.compatibility_problems()
    assert any("`_global_batch_size`" in p for p in problems)
    assert any("`_get_local_replica_id`" in p for p in problems)


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
    monkeypatch.delattr(getattr(checks, owner), name)
    assert any(reported in p for p in _tf_internal.compatibility_problems())


def test_a_keras_variable_that_keeps_its_checkpoint_to_itself_is_reported(monkeypatch):
    monkeypatch.setattr(keras.Variable, "_serialize_to_tensors", lambda self: {})
    problems = _tf_internal.compatibility_problems()
    assert any("keras.Variable._serialize_to_tensors no longer" in p for p in problems)
    monkeypatch.setattr(checks, "ResourceVariable", type("Bare", (), {}))
    problems = _tf_internal.compatibility_problems()
    assert any("ResourceVariable._restore_from_tensors is gone" in p for p in problems)


def test_an_sgd_that_no_longer_reads_its_momentum_as_a_number_is_reported(monkeypatch):
    monkeypatch.setattr(keras.optimizers.SGD, "update_step", lambda self, g, v, lr: None)
    problems = _tf_internal.compatibility_problems()
    assert any("SGD.update_step no longer reads `self.momentum`" in p for p in problems)


# Where tf_diffmap may reach into TensorFlow's or Keras' private parts.
PRIVATE_REACHES = (
    "import tensorflow.python",
    "from tensorflow.python",
    "keras.src",
    "sys._getframe",
    "register_tensor_conversion_function",
    "._update_input(",
    "._set_device(",
    "._is_stateful",
    "__class__ = ",
)


def test_only_the_internal_package_reaches_into_private_apis():
    internal = pathlib.Path(_tf_internal.__file__).parent
    package = internal.parent
    outside = {
        f"{p.relative_to(package)}: {reach}"
        for p in package.rglob("*.py")
        if internal not in p.parents
        for reach in PRIVATE_REACHES
        if reach in p.read_text()
    }
    assert not outside, sorted(outside)
    inside = "".join(p.read_text() for p in internal.glob("*.py"))
    assert "from tensorflow.python" in inside and "register_tensor_conversion" not in inside


# -- every hook the strategy overrides, routed through TensorFlow and Keras -----

# Each hook, and the flow in which TensorFlow or Keras calls it: "fit",
# "evaluate" and "predict" of a Keras model; a "custom loop" of `strategy.run`
# over a distributed dataset; Keras' "eager update" (`apply_gradients`
# outside `strategy.run`); the "tf.distribute API" (public methods of the
# strategy and its `extended`, which call the private hooks); and
# "TensorFlow's Keras 2" (the `tf.distribute` utilities in
# `tensorflow.python.keras`, the one caller left of two hooks that every
# TensorFlow strategy defines).
ROUTES = {
    "_create_variable": "fit",
    "_validate_colocate_with_variable": "fit",
    "colocate_vars_with": "fit",
    "_num_replicas_in_sync": "fit",
    "_use_merge_call": "fit",
    "_call_for_each_replica": "fit",
    "_replica_ctx_all_reduce": "fit",
    "_replica_ctx_update": "fit",
    "_get_local_replica_id": "fit",
    "_experimental_distribute_dataset": "fit",
    "_local_results": "predict",
    "value_container": "predict",
    "_update": "eager update",
    "_reduce_to": "custom loop",
    "_gather_to_implementation": "custom loop",
    "_distribute_datasets_from_function": "custom loop",
    "_batch_reduce_to": "tf.distribute API",
    "_broadcast_to": "tf.distribute API",
    "_update_non_slot": "tf.distribute API",
    "_experimental_distribute_values_from_function": "tf.distribute API",
    "non_slot_devices": "tf.distribute API",
    "variable_created_in_scope": "tf.distribute API",
    "read_var": "tf.distribute API",
    "worker_devices": "tf.distribute API",
    "parameter_devices": "tf.distribute API",
    "experimental_between_graph": "tf.distribute API",
    "experimental_should_init": "tf.distribute API",
    "should_checkpoint": "tf.distribute API",
    "should_save_summary": "tf.distribute API",
    "_in_multi_worker_mode": "TensorFlow's Keras 2",
    "_global_batch_size": "TensorFlow's Keras 2",
}


def _overridden_hooks() -> set[str]:
    """What `AsyncExtended` defines that TensorFlow's `StrategyExtended`, or
    one of TensorFlow's own strategies, defines too."""
    tensorflow_names = set()
    for cls in [*_tf_internal.ExtendedBase.__mro__, *checks._built_in_extended_classes()]:
        tensorflow_names.update(vars(cls))
    return {n for n in vars(Extended) if n in tensorflow_names and not n.startswith("__")}


def test_every_hook_is_checked_and_routed():
    """The tables name every override, and each names an override."""
    checked = {
        *_tf_internal.EXTENDED_HOOKS,
        *_tf_internal.BUILT_IN_HOOKS,
        *_tf_internal.PUBLIC_OVERRIDES,
    }
    overridden = _overridden_hooks()
    assert checked == overridden, (
        f"hooks the strategy overrides that `checks` does not list: {overridden - checked}; "
        f"listed hooks the strategy no longer overrides: {checked - overridden}"
    )
    assert set(ROUTES) == overridden


def _recorded(name: str, member, calls, flow, probes):
    """`member` of `AsyncExtended`, recording each call under the current flow."""
    probe = probes.get(name)
    if isinstance(member, property):

        def get(self):
            calls[name].add(flow[0])
            return member.fget(self)

        return property(get)

    @functools.wraps(member)
    def method(self, *args, **kwargs):
        calls[name].add(flow[0])
        if probe is not None:
            probe(*args, **kwargs)
        return member(self, *args, **kwargs)

    return method


def _keras_flows(strategy, run, seen):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, :2] * 2.0).astype("float32")
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse")
    seen["optimizer"] = model.optimizer
    run("fit", lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_data=(x, y)))
    run("evaluate", lambda: model.evaluate(x, y, batch_size=16, verbose=0))
    run("predict", lambda: seen.setdefault("predicted", model.predict(x, verbose=0)))


def _custom_loop(strategy, run, seen):
    x = np.ones((8, 4), "float32")
    with strategy.scope():
        kernel = tf.Variable(tf.ones([4, 1]))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([kernel])

    @tf.function
    def step(batch):
        def replica(batch):
            with tf.GradientTape() as tape:
                loss = tf.reduce_sum(tf.matmul(batch, kernel))
            optimizer.apply_gradients(zip(tape.gradient(loss, [kernel]), [kernel]))
            return loss

        loss = strategy.run(replica, args=(batch,))
        return strategy.reduce("SUM", loss, axis=None), strategy.gather(loss, axis=0)

    def loop():
        batches = tf.data.Dataset.from_tensor_slices(x).batch(4)
        for batch in strategy.experimental_distribute_dataset(batches):
            seen["reduced"], seen["gathered"] = step(batch)
        made = strategy.distribute_datasets_from_function(
            lambda context: tf.data.Dataset.from_tensor_slices(x).batch(2)
        )
        seen["from function"] = next(iter(made)).shape.as_list()

    run("custom loop", loop)

    def eager_update():
        optimizer.apply_gradients([(tf.ones([4, 1]), kernel)])
        seen["kernel"] = kernel.numpy()

    run("eager update", eager_update)
    return kernel


def _api_flow(strategy, kernel, run, seen):
    extended = strategy.extended

    def api():
        seen["non slot"] = extended.update_non_slot([kernel], lambda: tf.constant(7.0))
        seen["non slot devices"] = extended.non_slot_devices([kernel])
        seen["batch reduced"] = extended.batch_reduce_to("SUM", [(tf.constant(2.0), kernel)])
        seen["broadcast"] = extended.broadcast_to(tf.constant(3.0), kernel)
        with pytest.raises(NotImplementedError, match="tf_diffmap.Strategy feeds whole"):
            strategy.experimental_distribute_values_from_function(lambda context: 1.0)
        seen["in scope"] = extended.variable_created_in_scope(kernel)
        seen["outside"] = extended.variable_created_in_scope(tf.Variable(1.0))
        seen["read"] = extended.read_var(kernel)
        seen["facts"] = {
            name: getattr(extended, name)
            for name in checks.PUBLIC_OVERRIDES
            if isinstance(getattr(type(extended), name, None), property)
        }

    run("tf.distribute API", api)

    def keras_2():
        from tensorflow.python.keras.distribute import (
            distributed_file_utils,
            distributed_training_utils,
        )

        seen["dirpath"] = distributed_file_utils.write_dirpath("/tmp/unused", strategy)
        seen["global batch"] = distributed_training_utils.global_batch_size_supported(strategy)

    run("TensorFlow's Keras 2", keras_2)


@pytest.fixture(scope="module")
def routes():
    """Runs every flow once with a recorder around each hook.

    Returns `(calls, seen, errors)`: per hook, the flows that called it;
    what the flows observed; per flow, the error that stopped it.
    """
    calls = collections.defaultdict(set)
    flow = ["building"]
    seen: dict = {"inference": [], "update owners": set()}
    errors: dict[str, BaseException] = {}

    def note_inference(*args, **kwargs):
        seen["inference"].append((flow[0], _tf_internal.for_keras_inference()))

    def note_owner(var, fn, *args, **kwargs):
        seen["update owners"].add(_tf_internal.optimizer_of_update(fn))

    probes = {
        "_experimental_distribute_dataset": note_inference,
        "_replica_ctx_update": note_owner,
    }

    def run(name, body):
        flow[0] = name
        try:
            body()
        except Exception as error:  # reported by the tests of the hooks it calls
            errors[name] = error

    with pytest.MonkeyPatch.context() as patch:
        for name in ROUTES:
            if name in vars(Extended):
                patch.setattr(
                    Extended, name, _recorded(name, vars(Extended)[name], calls, flow, probes)
                )
        strategy = tf_diffmap.Strategy(devices=["CPU:0", "CPU:1"])
        try:
            _keras_flows(strategy, run, seen)
            kernel = _custom_loop(strategy, run, seen)
            _api_flow(strategy, kernel, run, seen)
        finally:
            strategy.shutdown()
    return calls, seen, errors


@pytest.mark.parametrize("hook", sorted(ROUTES))
def test_tensorflow_routes_through_the_hook(routes, hook):
    calls, _, errors = routes
    flow = ROUTES[hook]
    assert hook in vars(Extended), f"AsyncExtended no longer overrides `{hook}`"
    if flow in calls[hook]:
        return
    assert flow not in errors, f"the {flow} flow failed before reaching `{hook}`: {errors[flow]!r}"
    assert flow in calls[hook], (
        f"TensorFlow {tf.__version__} with Keras {keras.__version__} no longer calls "
        f"`AsyncExtended.{hook}` in {flow} (it was called in: {sorted(calls[hook]) or 'none'})"
    )


def test_the_flows_see_what_the_hooks_return(routes):
    _, seen, errors = routes
    assert not errors, errors
    assert seen["predicted"].shape == (64, 2)
    assert np.isfinite(seen["reduced"]) and np.isfinite(seen["gathered"]).all()
    assert seen["from function"] == [4, 4]  # two replicas' batches of 2, joined
    assert float(seen["non slot"]) == 7.0
    assert seen["non slot devices"]
    assert len(seen["batch reduced"]) == 1
    assert float(seen["broadcast"]) == 3.0
    assert seen["in scope"] is True and seen["outside"] is False
    np.testing.assert_array_equal(seen["read"], seen["kernel"])
    assert seen["facts"]["worker_devices"] and seen["facts"]["parameter_devices"]
    assert seen["facts"]["experimental_between_graph"] is False
    assert seen["facts"]["experimental_should_init"] is True
    assert seen["facts"]["should_checkpoint"] is True
    assert seen["facts"]["should_save_summary"] is True
    assert seen["dirpath"] == "/tmp/unused"  # not multi-worker: unchanged
    assert seen["global batch"] is True


def test_keras_says_which_of_fit_evaluate_and_predict_asks_for_a_dataset(routes):
    """`for_keras_inference` (a walk up Keras' stack) tells `fit`'s training
    data from its validation data and from `evaluate`'s and `predict`'s."""
    _, seen, _ = routes
    assert seen["inference"] == [
        ("fit", False),
        ("fit", True),
        ("evaluate", True),
        ("predict", True),
        ("custom loop", False),
    ]
    assert _tf_internal.for_keras_inference() is False


def test_keras_hands_each_update_to_the_strategy_as_its_optimizer_s_function(routes):
    _, seen, _ = routes
    owners = seen["update owners"] - {None}
    assert seen["optimizer"] in owners
    assert all(isinstance(o, keras.optimizers.Optimizer) for o in owners)
    assert _tf_internal.optimizer_of_update(lambda var: var) is None


def test_keras_optimizers_remember_the_strategy_they_were_created_under():
    """What the outside-the-scope error reads, and the error it replaces."""
    outside = keras.optimizers.SGD(0.1)
    assert _tf_internal.optimizer_strategy(outside) is tf.distribute.get_strategy()
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        assert _tf_internal.optimizer_strategy(keras.optimizers.SGD(0.1)) is strategy
        model_variable = tf.Variable(1.0)
    assert strategy.extended._container_strategy() is strategy
    assert _tf_internal.optimizer_strategy(object()) is None
    # TensorFlow's own error when it makes a slot there (the base class's
    # scope: tf_diffmap's replaces this error with its own).
    with pytest.raises(RuntimeError) as raised, tf.distribute.Strategy.scope(strategy):
        outside.add_variable_from_reference(model_variable, name="momentum")
    assert _tf_internal.is_mixed_strategy_error(raised.value)
    assert not _tf_internal.is_mixed_strategy_error(RuntimeError("something else"))


# -- Keras' optimizers -------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        lambda: keras.optimizers.Adam(0.1, amsgrad=True),
        lambda: keras.optimizers.Adagrad(0.1),
        lambda: keras.optimizers.Ftrl(0.1),
    ],
    ids=["SGD", "Adam", "Adagrad", "Ftrl"],
)
def test_the_slots_found_are_the_ones_the_optimizer_updates(make):
    optimizer = make()
    first, second = tf.Variable(tf.ones([3, 2])), tf.Variable(tf.ones([2]))
    optimizer.build([first, second])
    slots = _tf_internal.optimizer_slots(optimizer, second)
    held = {id(v.value if isinstance(v, keras.Variable) else v) for v in optimizer.variables}
    assert slots and all(id(slot) in held for slot in slots.values())
    assert all(slot.shape == second.shape for slot in slots.values())
    before = {name: slot.numpy().copy() for name, slot in slots.items()}
    optimizer.apply_gradients([(tf.zeros([3, 2]), first), (tf.ones([2]), second)])
    moved = [name for name, slot in slots.items() if not np.array_equal(slot.numpy(), before[name])]
    assert moved, "no slot found for the variable changed when it was updated"


def test_sgd_updates_with_the_momentum_chosen_for_the_update():
    """SGD, told momentum 0.5 for an update (its own is 0.9), applies 0.5."""
    sgd = keras.optimizers.SGD(0.1, momentum=0.9)
    variable = tf.Variable(1.0)
    sgd.build([variable])
    sgd.momentums[0].assign(1.0)

    @tf.function
    def update(momentum):
        with _tf_internal.momentum_of_update(sgd, momentum):
            sgd.apply_gradients([(tf.constant(1.0), variable)])

    update(tf.constant(0.5))
    assert sgd.momentum == 0.9  # restored
    np.testing.assert_allclose(sgd.momentums[0].numpy(), 0.5 * 1.0 - 0.1 * 1.0)
    np.testing.assert_allclose(variable.numpy(), 1.0 + 0.4)
    stand_in = _tf_internal.TracedMomentum(0.9, tf.constant(0.25))
    assert stand_in != 0 and stand_in == 0.9 and float(stand_in) == 0.9
    assert float(tf.convert_to_tensor(stand_in)) == 0.25
    assert tf.cast(stand_in, tf.float16).dtype == tf.float16


# -- the strategy's runtime --------------------------------------------------------


def test_a_thread_that_installs_the_summary_state_writes_where_the_caller_does(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    with writer.as_default(step=3):
        install = _tf_internal.capture_summary_state()
    written = {}

    def helper(key, installs):
        if installs:
            install()
        written[key] = bool(tf.summary.scalar("x", 1.0)), tf.summary.experimental.get_step()

    for key, installs in (("installed", True), ("bare", False)):
        thread = threading.Thread(target=helper, args=(key, installs))
        thread.start()
        thread.join()
    assert written["installed"][0] is True and int(written["installed"][1]) == 3
    assert written["bare"] == (False, None)


def test_a_graph_compiled_by_xla_is_told_apart():
    seen = {}

    def probe(key):
        def body(x):
            seen[key] = _tf_internal.in_xla_context()
            return x + 1.0

        return body

    tf.function(probe("xla"), jit_compile=True).get_concrete_function(tf.TensorSpec([]))
    tf.function(probe("plain")).get_concrete_function(tf.TensorSpec([]))
    assert seen == {"xla": True, "plain": False}


def test_a_dataset_s_traced_functions_are_found_through_its_inputs():
    """What keeps a replaced input's functions registered on a cluster
    while a worker is lost (`dataset_functions`, private `tf.data` API)."""
    dataset = tf.data.Dataset.range(8).map(lambda x: x * 2).filter(lambda x: x > 2).batch(2)
    functions = _tf_internal.dataset_functions(dataset)
    assert len(functions) == 2  # the map's and the filter's, found through `batch`
    assert all(isinstance(f, tf.types.experimental.ConcreteFunction) for f in functions)
    assert _tf_internal.dataset_functions(tf.data.Dataset.range(3)) == []


def test_a_client_connected_to_no_cluster_has_no_addresses():
    """`reconnect_cluster` needs a cluster: the slow tests restart one's workers."""
    assert _tf_internal.cluster_addresses() == {}


def test_whether_the_runtime_started_is_read_from_the_eager_context():
    """`cluster.launcher` forks only where it has not (tests/test_launcher.py
    runs a process where it has not: `import tensorflow` alone). Where the
    members read move, `runtime_started` says True (nothing is forked):
    this test fails instead."""
    from tensorflow.python.eager import context

    tf.constant(1.0)
    ctx = context.context_safe()
    assert ctx._initialized is True and ctx._context_handle is not None
    assert _tf_internal.runtime_started()


def test_the_store_version_counter_op_counts_up_to_its_limit():
    counter = tf.Variable(tf.constant(0, tf.int64))
    before = [
        int(tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=2, T=tf.int64))
        for _ in range(2)
    ]
    assert before == [0, 1] and int(counter.numpy()) == 2
    with pytest.raises(tf.errors.OutOfRangeError):
        tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=2, T=tf.int64)


# -- the store's variables: a class switched, its read hook, tape records -----------


@contextlib.contextmanager
def _tracing_replica_step(reads_as_rows=False):
    """This thread traces a replica step in the graph being built."""
    tracing = _tf_internal.replica_tracing()
    saved = (tracing.active, tracing.step_graph, tracing.snapshots, tracing.reads_as_rows)
    saved_stand_ins = tracing.stand_ins
    tracing.active, tracing.step_graph = True, tf.compat.v1.get_default_graph()
    tracing.snapshots, tracing.reads_as_rows, tracing.stand_ins = {}, reads_as_rows, {}
    try:
        yield tracing
    finally:
        tracing.active, tracing.step_graph, tracing.snapshots, tracing.reads_as_rows = saved
        tracing.stand_ins = saved_stand_ins


def test_a_variable_switched_to_a_store_variable_keeps_what_it_was(tmp_path):
    accesses = []
    with tf.device("CPU:0"):
        plain = tf.Variable([1.0, 2.0], name="kept", trainable=False)
    variable = _tf_internal.StoreVariable.adopt(plain, lambda: accesses.append(1))
    assert variable is plain and type(variable) is _tf_internal.StoreVariable
    assert isinstance(variable, _tf_internal.ResourceVariable) and isinstance(variable, tf.Variable)
    assert variable.name == "kept:0" and variable.trainable is False
    assert variable.shape == [2] and "CPU:0" in variable.device
    # Every eager read goes through the overridden `_read_variable_op`.
    for access in (
        variable.read_value,
        variable.value,
        lambda: tf.convert_to_tensor(variable),
        lambda: variable + 1.0,
        variable.numpy,
        # And every write goes through the store's methods.
        lambda: variable.assign([3.0, 4.0]),
        lambda: variable.assign_add([1.0, 1.0]),
        lambda: variable.assign_sub([0.5, 0.5]),
    ):
        count = len(accesses)
        access()
        assert len(accesses) > count, access
    checkpoint = tf.train.Checkpoint(v=variable)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    variable.assign([0.0, 0.0])
    checkpoint.read(path).assert_consumed()
    np.testing.assert_array_equal(variable.numpy(), [3.5, 4.5])
    assert _tf_internal.StoreVariable.adopt(variable, lambda: None) is variable  # once


def test_store_variable_rewrites_keras_assign_add_as_atomic_add():
    variable = _tf_internal.StoreVariable.adopt(tf.Variable(1.0), lambda: None)

    @tf.function
    def step():
        with _tracing_replica_step():
            variable.assign(variable + 2.0)

    graph = step.get_concrete_function().graph
    types = [op.type for op in graph.get_operations()]
    assert "AssignAddVariableOp" in types
    assert "AssignVariableOp" not in types
    step()
    assert variable.numpy() == 3.0


def test_store_variable_notes_a_write_that_is_not_an_addition():
    variable = _tf_internal.StoreVariable.adopt(tf.Variable(1.0, name="noted"), lambda: None)
    noted = []

    @tf.function
    def step():
        with _tracing_replica_step() as tracing:
            tracing.plain_writes = noted
            variable.assign(variable + 2.0)  # atomic: not noted
            variable.assign_add(1.0)
            variable.assign_sub(1.0)
            assert noted == []
            variable.assign(tf.constant(5.0))
            tracing.plain_writes = None

    step.get_concrete_function()
    assert noted == ["noted:0"]


def test_keras_reduces_a_per_replica_value_over_its_replicas():
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    strategy = tf_diffmap.Strategy()
    rows = _tf_internal.per_replica([tf.constant([1.0, 2.0]), tf.constant([3.0]), tf.zeros([0])])
    assert len(_tf_internal.replica_values(rows)) == 3
    assert _tf_internal.replica_values(tf.constant(1.0)) is None
    np.testing.assert_array_equal(reduce_per_replica(rows, strategy, "concat"), [1.0, 2.0, 3.0])
    scalars = _tf_internal.per_replica([tf.constant(1.0), tf.constant(3.0)])
    assert float(reduce_per_replica(scalars, strategy, "mean")) == 2.0
    assert float(strategy.reduce("SUM", scalars, axis=None)) == 4.0
    assert float(strategy.reduce("MEAN", rows, axis=0)) == 2.0
    np.testing.assert_array_equal(strategy.gather(rows, axis=0), [1.0, 2.0, 3.0])
    assert len(strategy.experimental_local_results(rows)) == 3


def test_a_snapshot_variable_is_read_once_per_replica_step():
    variable = _tf_internal.StoreVariable.adopt(tf.Variable(2.0), lambda: None)
    variable.snapshot_in_steps()
    reads = {}

    @tf.function
    def step():
        with _tracing_replica_step():
            reads["first"] = variable.read_value()
            variable.assign_add(1.0, read_value=False)
            reads["second"] = variable.read_value()
        return reads["first"] * reads["second"]

    graph = step.get_concrete_function().graph
    assert reads["first"].op.inputs[0] is reads["second"].op.inputs[0]
    assert len([op for op in graph.get_operations() if op.type == "ReadVariableOp"]) == 1
    assert float(step()) == 2.0 * 2.0  # both before the update (else 2.0 * 3.0)


def test_recorded_reads_carry_gradients_to_the_variable():
    variable = tf.Variable(tf.ones([4, 2]))
    ids = tf.constant([3, 1, 3], tf.int64)
    with tf.GradientTape(persistent=True) as tape:
        value = tf.constant(variable.numpy())
        _tf_internal.record_read(variable, value)
        rows = tf.gather(tf.constant(variable.numpy()), ids)
        _tf_internal.record_rows_read(variable, ids, rows)
        whole, looked_up = tf.reduce_sum(value * 3.0), tf.reduce_sum(rows)
    np.testing.assert_array_equal(tape.gradient(whole, variable), np.full((4, 2), 3.0))
    gradient = tape.gradient(looked_up, variable)
    assert isinstance(gradient, tf.IndexedSlices)
    assert gradient.indices.numpy().tolist() == [3, 1, 3]
    assert gradient.dense_shape.numpy().tolist() == [4, 2]


def test_a_split_variable_s_hooks_are_the_ones_tensorflow_and_keras_call(tmp_path, monkeypatch):
    """`PartitionedVariable` overrides a read hook and the checkpoint and
    SavedModel hooks of a variable; TensorFlow calls each, and a Keras
    variable hands its checkpoint over to its `tf.Variable`."""
    from tf_diffmap.store.partitioned import PartitionedVariable, RowSplit

    called = collections.Counter()
    for name in ("_read_variable_op", *_tf_internal.SPLIT_VARIABLE_HOOKS):
        original = getattr(PartitionedVariable, name)

        def recorder(self, *args, _original=original, _name=name, **kwargs):
            called[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(PartitionedVariable, name, recorder)
    initial = np.arange(10, dtype="float32").reshape(5, 2)
    shards = [tf.Variable(initial[:3]), tf.Variable(initial[3:])]
    table = PartitionedVariable.build(shards, RowSplit((3, 2)), name="table", trainable=True)
    np.testing.assert_array_equal(tf.convert_to_tensor(table), initial)
    assert called["_read_variable_op"] >= 1
    checkpoint = tf.train.Checkpoint(table=table)
    path = checkpoint.write(str(tmp_path / "split"))
    table.assign(np.zeros((5, 2), "float32"))
    checkpoint.read(path)
    np.testing.assert_array_equal(shards[1].numpy(), initial[3:])
    assert called["_serialize_to_tensors"] >= 1 and called["_restore_from_tensors"] == 1
    module = tf.Module()
    module.table = table
    with pytest.raises(NotImplementedError, match="split by rows"):
        tf.saved_model.save(module, str(tmp_path / "saved"))
    assert called["_export_to_saved_model_graph"] == 1
    # Keras' variables hand their checkpoints over to their tf.Variable.
    handed = collections.Counter()
    serialize = _tf_internal.ResourceVariable._serialize_to_tensors

    def counted(self):
        handed["serialize"] += 1
        return serialize(self)

    monkeypatch.setattr(_tf_internal.ResourceVariable, "_serialize_to_tensors", counted)
    weight = keras.Variable(np.ones(3, "float32"))
    tf.train.Checkpoint(weight=weight).write(str(tmp_path / "keras"))
    assert handed["serialize"] >= 1


# -- rewrites of a traced step's graph ---------------------------------------------


def test_row_gathers_of_a_large_table_become_gathers_beside_it():
    """Inside a replica step a large table's read is a stand-in; at the claim
    each row gather of it is rewired to a gather beside the table, any other
    use to a whole read, and a use made after the claim to those reads."""
    rows = _tf_internal.ROWS_READ_BYTES // (4 * 64)
    initial = np.random.default_rng(1).normal(size=(rows, 64)).astype("float32")
    table = _tf_internal.StoreVariable.adopt(tf.Variable(initial), lambda: None)
    made = {}

    @tf.function(autograph=False)
    def step(ids):
        with _tracing_replica_step(reads_as_rows=True):
            value = table.value()
            gathered = tf.gather(value, ids)
            summed = tf.reduce_sum(value)
            used = gathered * 2.0
            resolved = _tf_internal.resolve_row_reads()
            late = gathered + 1.0  # made after the claim
            outputs = _tf_internal.rewire_late_uses(resolved, (used, summed, late, gathered))
        made.update(value=value, gathered=gathered, used=used, summed=summed, late=late)
        made["reads"] = resolved[id(table)]
        return outputs

    step.get_concrete_function(tf.TensorSpec([None], tf.int64))
    reads = made["reads"]
    assert reads.variable is table and len(reads.lookups) == 1
    gather_beside = made["used"].op.inputs[0].op
    assert gather_beside.type == "ResourceGather"
    assert made["late"].op.inputs[0] is gather_beside.outputs[0]
    assert made["summed"].op.inputs[0] is reads.value
    assert reads.value.op.type == "ReadVariableOp"
    assert not made["value"].consumers() or all(
        c.type == "GatherV2" for c in made["value"].consumers()
    )
    ids = tf.constant([5, 0, 5], tf.int64)
    used, summed, late, gathered = step(ids)
    np.testing.assert_array_equal(gathered, initial[[5, 0, 5]])
    np.testing.assert_array_equal(used, initial[[5, 0, 5]] * 2.0)
    np.testing.assert_array_equal(late, initial[[5, 0, 5]] + 1.0)
    np.testing.assert_allclose(summed, initial.sum(), rtol=1e-5)


def test_the_control_dependencies_tf_function_adds_are_the_ones_predicted():
    """`graphs.successors` re-implements the edges `tf.function` adds between
    ops once a trace ends; packing values must not invert any of them."""
    from tf_diffmap._tf_internal import graphs

    first, second = tf.Variable(1.0), tf.Variable(2.0)
    seen = {}

    @tf.function(autograph=False)
    def step(x):
        first.assign_add(x)
        read = first.read_value()
        second.assign(read * 2.0)
        first.assign_sub(1.0)
        tf.print(x, output_stream=sys.stderr)  # stateful, on no resource
        tf.print(read, output_stream=sys.stderr)
        operations = tf.compat.v1.get_default_graph().get_operations()
        seen["operations"] = operations
        seen["before"] = {op: set(op.control_inputs) for op in operations}
        return second.read_value()

    step.get_concrete_function(tf.TensorSpec([]))
    operations, before = seen["operations"], seen["before"]
    after = graphs.successors(operations)
    added = [
        (control, op)
        for op in operations
        for control in set(op.control_inputs) - before[op]
        if control in before
    ]
    assert added, "tf.function added no control dependency between the traced ops"
    unpredicted = [
        (control.name, op.name)
        for control, op in added
        if op not in graphs.reaches(after, [control])
    ]
    assert not unpredicted, unpredicted


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
    for function in graph_def.library.function:
        for node in function.node_def:
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
            steps = tf.compat.v1.placeholder(tf.int64, [], name="steps")
            kernel_read, bias_read = tf.identity(kernel), tf.identity(bias)
            far = tf.compat.v1.placeholder(tf.float64, [], name="far")  # all 8 bytes
        with tf.device(WORKER):
            x = tf.compat.v1.placeholder(tf.float32, [4, 3], name="x")
            logits = tf.matmul(x, kernel_read) + bias_read
            loss = tf.reduce_sum(logits * logits)
            # The gradients of the loss, written out (tf.gradients colocates
            # its ops with the forward ones, as a GradientTape does not).
            kernel_grad = 2.0 * tf.matmul(x, logits, transpose_a=True)
            bias_grad = 2.0 * tf.reduce_sum(logits, axis=0)
            counted = steps + 1
            positive = loss > 0.0
            halves = tf.cast(x[0], tf.float16)
            small = tf.cast(steps, tf.int32) - 7
            near = far * 3.0
        with tf.device(PS):
            new_kernel = kernel_read - 0.1 * kernel_grad
            new_bias = bias_read - 0.1 * bias_grad
            counted_there = counted * 2
            both = tf.logical_and(positive, True)
            halves_there = halves * 2.0
            small_there = small * 3
            near_there = near + 0.0
    before = {op.name for op in graph.get_operations()}
    rng = np.random.default_rng(0)
    feeds = {
        kernel: rng.normal(size=(3, 2)).astype("float32"),
        bias: rng.normal(size=2).astype("float32"),
        steps: 4,
        x: rng.normal(size=(4, 3)).astype("float32"),
        far: 1.0 / 3.0,
    }
    fetches = [new_kernel, new_bias, counted_there, loss, both, halves_there, small_there]
    fetches.append(near_there)
    expected = _run_without_devices(graph, fetches, feeds)

    # Four values to the worker (two parameters, an int64 and a float64),
    # seven back, of six dtypes: one pack each way.
    assert _tf_internal.pack_crossings(graph) == 11
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
                if tensor.op.device and tensor.op.device != op.device:
                    assert tensor.op.name.startswith(_tf_internal.PACKED_SCOPE), op.name
    actual = _run_without_devices(graph, fetches, feeds)
    for want, got in zip(expected, actual):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)  # bit for bit


def test_a_conditional_takes_what_another_task_sends_it_in_one_pack():
    """A conditional on the ps whose inputs (and predicate) come from the
    worker: each would travel alone into its branch; brought to the
    conditional's device, they travel as one pack."""
    import numpy as np

    graph = tf.Graph()
    with graph.as_default():
        with tf.device(WORKER):
            x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
            n = tf.compat.v1.placeholder(tf.int64, [], name="n")
            gradient, count, go = x * 2.0, n + 1, tf.reduce_sum(x) > 0.0
        with tf.device(PS):
            total = tf.compat.v1.placeholder(tf.float32, [3], name="total")
            out = tf.cond(go, lambda: (total + gradient, count * 2), lambda: (total, count))
    feeds = {x: [1.0, -2.0, 3.0], n: 5, total: [0.5, 0.5, 0.5]}
    expected = _run_without_devices(graph, list(out), feeds)
    conditional = out[0].op.inputs[0].op
    assert conditional.type in ("If", "StatelessIf")
    # The predicate, the gradient and the count.
    assert _tf_internal.pack_crossings(graph) == 3
    for tensor in conditional.inputs:
        if tensor.dtype != tf.resource:
            assert tf.DeviceSpec.from_string(tensor.op.device).job == "ps", tensor.name
    actual = _run_without_devices(graph, list(out), feeds)
    for want, got in zip(expected, actual):
        np.testing.assert_array_equal(got, want)


def test_a_value_that_waits_for_its_packs_consumers_is_not_packed():
    """Packing b with a would make b wait for itself: b is computed on the ps
    from what the worker made of a. b and c, both after the worker's use of
    a, travel in a second pack of their own."""
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
    assert _tf_internal.pack_crossings(graph) == 4  # a and d, then b and c
    joins = [op for op in graph.get_operations() if op.type == "ConcatV2"]

    def origin(tensor):
        while tensor.op.name.startswith(_tf_internal.PACKED_SCOPE):
            tensor = tensor.op.inputs[0]
        return tensor.name

    packs = [{origin(t) for t in join.inputs[:-1]} for join in joins]
    assert sorted(map(sorted, packs)) == [["Identity:0", "Identity_1:0"], ["Identity_2:0", "add:0"]]
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


def test_remote_requests_stream_while_a_task_is_quiet_and_wait_again_after(monkeypatch):
    import os

    from tf_diffmap._tf_internal import remote_functions

    monkeypatch.setenv(remote_functions.STREAMING, "False")
    remote_functions.quiet_tasks({"/job:worker/replica:0/task:1"})
    assert os.environ[remote_functions.STREAMING] == "True"
    remote_functions.quiet_tasks({"/job:worker/replica:0/task:1", "/job:worker/replica:0/task:2"})
    assert os.environ[remote_functions.STREAMING] == "True"
    remote_functions.quiet_tasks(set())
    assert os.environ[remote_functions.STREAMING] == "False"
    remote_functions.settle()  # no task quiet, no cluster: nothing to do


def test_a_regularized_model_is_built_from_its_batches_structure():
    """What Keras builds at the start of `fit` (the model, its compiled loss
    and metrics), built from the batches' structure: Keras' own build on a
    batch of no example (a cluster chief's token) fails with a regularizer,
    whose scalar penalty it cannot add to an empty loss vector."""
    strategy = tf_diffmap.Strategy()

    def compiled():
        with strategy.scope():
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras.layers.Dense(2, kernel_regularizer=keras.regularizers.l2(1e-3)),
                ]
            )
            model.compile(
                optimizer=keras.optimizers.SGD(0.05),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        return model

    token = (tf.zeros([0, 4]), tf.zeros([0], tf.int32))
    with pytest.raises((ValueError, tf.errors.InvalidArgumentError)):
        model = compiled()
        with strategy.scope():
            model._symbolic_build(data_batch=token)
    model = compiled()
    spec = tf.data.Dataset.from_tensors(token).element_spec
    _tf_internal.build_from_spec(model, spec)
    assert model._compile_loss.built and model._compile_metrics.built
    with strategy.scope():
        model._symbolic_build(data_batch=token)  # built already: Keras builds nothing


def test_the_model_whose_fit_runs_is_known_inside_its_fit():
    seen = []

    class Seen(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            seen.append(_tf_internal.fitting_model())

    tf_diffmap.Strategy()  # a strategy has every `fit` watched
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 4)), np.ones((8, 2)), epochs=1, verbose=0, callbacks=[Seen()])
    assert seen == [model] and _tf_internal.fitting_model() is None


def test_a_wait_for_a_value_that_travelled_packed_waits_for_its_piece():
    """The ps's update waits for the worker's gradient ops (a claim waits
    for the gradients): once the gradients travel packed, it waits for
    their pieces on the ps, and no control edge crosses the tasks."""
    import numpy as np

    graph = tf.Graph()
    with graph.as_default():
        with tf.device(WORKER):
            x = tf.compat.v1.placeholder(tf.float32, [3], name="x")
            first, second = x * 2.0, x + 1.0
        with tf.device(PS):
            total = tf.compat.v1.placeholder(tf.float32, [3], name="total")
            with tf.control_dependencies([first.op, second.op]):
                counted = tf.identity(total)
            out = counted + first + second
    expected = _run_without_devices(graph, [out], {x: [1.0, 2.0, 3.0], total: [0.5] * 3})
    assert _tf_internal.pack_crossings(graph) == 2
    for control in counted.op.control_inputs:
        assert control.device == PS and control.name.startswith(_tf_internal.PACKED_SCOPE)
    actual = _run_without_devices(graph, [out], {x: [1.0, 2.0, 3.0], total: [0.5] * 3})
    np.testing.assert_array_equal(actual[0], expected[0])
