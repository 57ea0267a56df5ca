"""A model that no strategy scope built trains as plain Keras: `fit` says so."""

import inspect
import warnings
import weakref

import keras
import pytest
import tensorflow as tf
from conftest import classification_data, compile_logits, mlp

import tf_diffmap
from tf_diffmap import _tf_internal, scope_watch


@pytest.fixture(autouse=True)
def only_this_tests_strategies(monkeypatch):
    # Strategies of other tests may still be alive; each test sees its own.
    monkeypatch.setattr(scope_watch, "_strategies", weakref.WeakSet())


def fit_and_catch(model, epochs: int = 1) -> tuple[list[warnings.WarningMessage], int]:
    """Fits `model` on a small problem; the warnings about scopes and the
    line of the `fit` call."""
    x, y = classification_data(n=128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        model.fit(x, y, batch_size=32, epochs=epochs, verbose=0)
    return [w for w in caught if "trains as plain Keras" in str(w.message)], line


def test_a_model_built_entirely_outside_the_scope_is_warned_about_once():
    strategy = tf_diffmap.Strategy()
    model = mlp()
    compile_logits(model, keras.optimizers.Adam(1e-3))
    found, line = fit_and_catch(model)
    assert len(found) == 1
    message = str(found[0].message)
    assert "built outside every tf_diffmap.Strategy's scope" in message
    assert "strategy.version stays 0" in message and "with strategy.scope():" in message
    # It names the user's line, not the package's wrapper.
    assert (found[0].filename, found[0].lineno) == (__file__, line)
    assert strategy.version == 0
    again, _ = fit_and_catch(model)
    assert again == []


def test_a_model_compiled_in_the_scope_but_built_outside_is_warned_about():
    strategy = tf_diffmap.Strategy()
    model = mlp()
    optimizer = keras.optimizers.Adam(1e-3)
    with strategy.scope():
        compile_logits(model, optimizer)
    found, _ = fit_and_catch(model)
    assert len(found) == 1
    assert "though it was compiled inside it" in str(found[0].message)
    assert strategy.version == 0


def test_a_model_built_in_the_scope_trains_without_a_word():
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        model = mlp()
        compile_logits(model)
    found, _ = fit_and_catch(model)
    assert found == []
    assert strategy.version > 0


def test_plain_keras_beside_a_strategy_that_built_a_model_is_left_alone():
    # Comparing plain Keras with the strategy is a use, not a mistake.
    strategy = tf_diffmap.Strategy()
    with strategy.scope():
        compile_logits(mlp())
    plain = mlp()
    compile_logits(plain)
    found, _ = fit_and_catch(plain)
    assert found == []


def test_without_a_strategy_nothing_is_checked():
    plain = mlp()
    compile_logits(plain)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope_watch.check_fit(plain)
    assert caught == []


def test_a_model_of_another_strategy_is_left_alone():
    tf_diffmap.Strategy()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = mlp()
        compile_logits(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope_watch.check_fit(model)
    assert caught == []


def test_an_optimizer_of_the_strategy_on_a_model_built_outside_is_left_to_the_error():
    # `fit` refuses that model with a ValueError that says what to do.
    strategy = tf_diffmap.Strategy()
    model = mlp()
    with strategy.scope():
        compile_logits(model, "adam")  # the optimizer is made in the scope
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scope_watch.check_fit(model)
    assert caught == []
    with pytest.raises(ValueError, match="created outside this tf_diffmap.Strategy's scope"):
        fit_and_catch(model)


def test_fit_is_wrapped_once_and_keeps_what_keras_checks_find():
    tf_diffmap.Strategy()
    tf_diffmap.Strategy()
    fit = keras.Model.fit
    assert getattr(fit, "_tf_diffmap_watched", False)
    assert not getattr(fit.__wrapped__, "_tf_diffmap_watched", False)
    assert keras.Sequential.fit is fit
    assert _tf_internal.compatibility_problems() == []
