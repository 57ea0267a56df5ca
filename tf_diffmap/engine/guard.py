"""Says so during training when the loss collapses.

Asynchronous training that diverges usually does so early and completely:
the loss becomes NaN or infinite, or climbs back towards where it started.
A user who sees it only in the final accuracy has lost the run.
`CollapseGuard` reads the most recent training loss about once a second
(one read of a variable on the client host, while the replicas run) and
warns, once per run of training, naming the store's mode (how shard
gradients become optimizer steps), the measured staleness and what to try.

The judgement is a plain function of the losses seen (`Collapse.observe`);
only `CollapseGuard` reads variables and runs a thread. The warning is
raised on the thread that trains (where training drains, at the latest at
the epoch's end), so that it names the user's line, not the watcher's.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable

import tensorflow as tf

from tf_diffmap import _tf_internal

__all__ = ["Collapse", "CollapseGuard", "RISE_OF_START"]

# A loss that rose above its lowest value so far by this fraction of its
# level at the start of training collapsed. The loss read is Keras' running
# mean of the epoch, which at an epoch's start covers a few batches only:
# near the end of a healthy run it wanders between a fraction and several
# times its lowest (a ratio of 4 to the lowest, the former rule, warned at
# 0.999 training accuracy), but by little against where it started. A model
# that diverged climbs back towards chance, near or above its start.
# Chosen on runs whose loss was read every 0.05 s, two at once on a busy
# 2-core host, with emulated device time: the largest rise of 9 healthy
# runs under the default (an MLP on two classes with SGD and momentum, one
# on digits with Adam; 2 seeds each, repeated) was 0.012 to 0.110 of the
# start; two runs of a step per shard with "none" that ended trained rose
# by 0.16 and 0.17; one that collapsed to chance by 0.38. Over twice the
# healthy largest, under the collapse. Checked afterwards on runs not used
# to choose it: 6 healthy ones (other seeds, digits with SGD, Adam on two
# classes) rose by 0.023 to 0.070, and 3 collapses by 0.37 to 0.68. A run
# that never learned (a step per shard that stayed near chance, rising by
# 0.12) is not called a collapse: its loss had not fallen to climb back from.
RISE_OF_START = 0.25
# Losses seen before a rise is judged: the highest of them is the level at
# the start, and the first readings of a run are the untrained model's.
MIN_READINGS = 3
# Readings in a row that must show the rise: the loss read is a running
# mean, Keras' total over its count, two variables that the replicas update
# one after the other, and a read between the two updates of another step
# can be several times the mean (1.88 between readings of 0.74, with a
# replica 100 times slower than the others). Where training drains at
# every batch (a callback that reads the weights), the guard reads at each
# drain, and two torn reads in a row were seen on a healthy run (0.634
# after a lowest of 0.481, in the fast suite); three were not. A collapse
# persists.
CONFIRMING_READINGS = 3


class Collapse:
    """The losses of one run of training, and whether they collapsed.

    Args:
        rise_of_start: a loss that rose above its running minimum by this
            fraction of its level at the start (the highest of the first
            `min_readings` readings) collapsed.
        min_readings: readings before a rise is judged (NaN and infinity
            are judged at once).
    """

    def __init__(self, rise_of_start: float = RISE_OF_START, min_readings: int = MIN_READINGS):
        self.rise_of_start = rise_of_start
        self.min_readings = min_readings
        self.reset()

    def reset(self) -> None:
        self.lowest = math.inf
        self.start = 0.0
        self.readings = 0
        # Readings in a row above the threshold.
        self.risen = 0

    def observe(self, loss: float) -> str | None:
        """Takes one reading; returns what collapsed, or None.

        A reading of exactly 0 is skipped: it is a step's outputs before
        any step wrote them (a loss that really reaches 0 loses little: the
        readings beside it are as low). A loss whose level at the start is
        not above 0 (a negative log-likelihood, a cosine similarity) gives
        no scale to judge a rise against: only NaN and infinity are judged.

        Examples:
            >>> from tf_diffmap.engine.guard import Collapse
            >>> collapse = Collapse()
            >>> [collapse.observe(x) for x in (2.3, 0.9, 0.5, 0.02)]
            [None, None, None, None]
            >>> collapse.observe(0.09)  # 4.5 times its lowest: noise near 0
            >>> collapse.observe(1.9)  # one reading: not yet
            >>> collapse.observe(1.9)
            >>> collapse.observe(1.9)
            'the loss rose to 1.9 from its lowest, 0.02, by 82% of its level at the start, 2.3'
            >>> collapse.observe(float("nan"))
            'the loss is nan'
        """
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        if loss == 0.0:
            return None
        self.readings += 1
        if self.readings <= self.min_readings:
            self.start = max(self.start, loss)
        elif self.start > 0 and loss - self.lowest > self.rise_of_start * self.start:
            self.risen += 1
            if self.risen < CONFIRMING_READINGS:
                return None
            return (
                f"the loss rose to {loss:.3g} from its lowest, {self.lowest:.3g}, by "
                f"{(loss - self.lowest) / self.start:.0%} of its level at the start, "
                f"{self.start:.3g}"
            )
        self.risen = 0
        self.lowest = min(self.lowest, loss)
        return None


class CollapseGuard:
    """Watches the training loss in a thread of its own while replicas run.

    Args:
        latest_loss: the most recent training loss, or None when there is
            none to read (no training step ran yet).
        training: whether replicas are training now (the thread ends
            when they stop; `start` begins it again).
        advice: what the warning says after what collapsed: the store's
            mode, the staleness and what to try.
        period: seconds between readings.
    """

    def __init__(
        self,
        latest_loss: Callable[[], float | None],
        training: Callable[[], bool],
        advice: Callable[[], str],
        period: float = 1.0,
    ):
        self._latest_loss = latest_loss
        self._training = training
        self._advice = advice
        self.period = period
        self.collapse = Collapse()
        self.warned = False
        # What collapsed, seen (on any thread) and not yet said.
        self._due: str | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # The watcher and a drain may read at once.
        self._reading = threading.Lock()

    def reset(self) -> None:
        """A new model or optimizer trains: forget the losses, warn again."""
        self.collapse.reset()
        self.warned = False
        self._due = None

    def start(self) -> None:
        """Starts watching, unless it watches already or has warned."""
        with self._lock:
            if self._due or self.warned or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="tf_diffmap-guard", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self, read: bool = True) -> None:
        """One reading now, then the warning if one is due and this thread
        runs the user's code (the watcher's does not: it leaves the warning
        to the next drain of the training thread).

        Args:
            read: take a reading; False only gives a warning already due (a
                drain with nothing in flight: the last reading stands).
        """
        if self.warned:
            return
        with self._reading:
            if read and self._due is None:
                loss = self._latest_loss()
                if loss is not None:
                    self._due = self.collapse.observe(loss)
        if self._due is None:
            return
        # Raised on the watcher's thread, the warning would name this file;
        # on the thread that trains it names the user's call of `fit`.
        # Neither the watcher nor an op of a graph that drains has a frame
        # of the user's on its stack.
        level = _tf_internal.user_stacklevel(fallback=0)
        if level == 0:
            return
        self.warned = True
        warnings.warn(
            f"Training is collapsing: {self._due}. {self._advice()}",
            UserWarning,
            stacklevel=level,
        )

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            if not self._training():
                return
            try:
                self.check()
            except tf.errors.OpError:
                # A read that fails (the loss lives on the client host, so
                # only as the process shuts down) ends the watch; the
                # replicas' own errors are raised where they happen.
                return
            if self._due or self.warned:
                return
