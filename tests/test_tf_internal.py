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
