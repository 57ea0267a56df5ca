"""The collapse guard: a diverging run is named while it trains."""

import math
import warnings

import keras
import numpy as np
import pytest

import tf_diffmap
from tests.conftest import classification_data, compile_logits, mlp
from tf_diffmap.engine.guard import Collapse


def test_a_rise_far_above_the_lowest_loss_or_a_nan_is_a_collapse():
    collapse = Collapse(rise_factor=4.0, min_readings=3)
    # Noise and a plateau are not.
    for loss in (2.3, 1.2, 0.6, 0.8, 0.55, 1.9, 0.5):
        assert collapse.observe(loss) is None
    assert "4.2 times its lowest" in collapse.observe(2.1)
    assert collapse.observe(math.inf) == "the loss is inf"
    fresh = Collapse(rise_factor=4.0, min_readings=3)
    assert fresh.observe(0.1) is None and fresh.observe(9.0) is None  # too early to judge


class _Epochs(keras.callbacks.Callback):
    """Records, at each epoch's end, how many collapse warnings were given."""

    def __init__(self, caught):
        super().__init__()
        self.caught = caught
        self.counts = []

    def on_epoch_end(self, epoch, logs=None):
        self.counts.append(sum("Training is collapsing" in str(w.message) for w in self.caught))


def _train(per_step, learning_rate, epochs=6):
    x, y = classification_data(2048)
    strategy = tf_diffmap.Strategy(gradients_per_step=per_step)
    with strategy.scope():
        model = mlp()
        compile_logits(model, keras.optimizers.SGD(learning_rate, momentum=0.9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs_seen = _Epochs(caught)
        model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=[epochs_seen])
    messages = [str(w.message) for w in caught if "Training is collapsing" in str(w.message)]
    return messages, epochs_seen.counts


@pytest.mark.parametrize("per_step", [1, "auto"], ids=["per_shard", "aggregated"])
def test_a_diverging_run_is_named_during_training_with_what_to_try(per_step):
    messages, counts = _train(per_step, learning_rate=40.0)
    assert len(messages) == 1, messages  # once
    # Said while training went on, not after it.
    assert counts[0] == 1 and counts[-1] == 1, counts
    message = messages[0]
    assert "mean staleness" in message
    if per_step == 1:
        assert "gradients_per_step=1" in message and 'gradients_per_step="auto"' in message
    else:
        assert "aggregates 4 shard gradients" in message and "lower learning rate" in message
        # Keeping only the freshest gradients lost to the default on the
        # grid's tuning half (docs/staleness-aware-updates.md): not advised.
        assert "max_step_staleness=0" not in message


def test_a_run_that_trains_is_not_warned_about():
    messages, counts = _train("auto", learning_rate=0.05, epochs=3)
    assert messages == [] and counts == [0, 0, 0]
    np.testing.assert_equal(len(counts), 3)
