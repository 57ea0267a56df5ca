"""Says so during training when the loss collapses.

Asynchronous training that diverges usually does so early and completely:
the loss becomes NaN or infinite, or climbs back far above the lowest it
reached. A user who sees it only in the final accuracy has lost the run.
`CollapseGuard` reads the most recent training loss about once a second
(one read of a variable on the client host, while the replicas run) and
warns, once per run of training, naming the store's mode (how shard
gradients become optimizer steps), the measured staleness and what to try.

The judgement is a plain function of the losses seen (`Collapse.observe`);
only `CollapseGuard` reads variables and runs a thread.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable

import tensorflow as tf

__all__ = ["Collapse", "CollapseGuard", "RISE_FACTOR"]

# A loss this many times its lowest value so far is a collapse. A loss that
# only wanders (the noise of an epoch's first batches, a loss that levels off)
# stays well under it; a model that diverged sits at chance or beyond, many
# times the loss it had reached.
RISE_FACTOR = 4.0
# Losses seen before a rise is judged: the first readings of a run are the
# untrained model's.
MIN_READINGS = 3


class Collapse:
    """The losses of one run of training, and whether they collapsed.

    Args:
        rise_factor: a loss this many times its running minimum collapsed.
        min_readings: readings before a rise is judged (NaN and infinity
            are judged at once).
    """

    def __init__(self, rise_factor: float = RISE_FACTOR, min_readings: int = MIN_READINGS):
        self.rise_factor = rise_factor
        self.min_readings = min_readings
        self.reset()

    def reset(self) -> None:
        self.lowest = math.inf
        self.readings = 0

    def observe(self, loss: float) -> str | None:
        """Takes one reading; returns what collapsed, or None.

        Examples:
            >>> from tf_diffmap.engine.guard import Collapse
            >>> collapse = Collapse()
            >>> [collapse.observe(x) for x in (2.3, 0.9, 0.5)]
            [None, None, None]
            >>> collapse.observe(2.4)
            'the loss rose to 2.4, 4.8 times its lowest, 0.5'
            >>> collapse.observe(float("nan"))
            'the loss is nan'
        """
        if not math.isfinite(loss):
            return f"the loss is {loss}"
        self.readings += 1
        rose = (
            self.readings > self.min_readings
            and self.lowest > 0
            and loss > self.rise_factor * self.lowest
        )
        if rose:
            return (
                f"the loss rose to {loss:.3g}, {loss / self.lowest:.1f} times its lowest, "
                f"{self.lowest:.3g}"
            )
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
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()

    def reset(self) -> None:
        """A new model or optimizer trains: forget the losses, warn again."""
        self.collapse.reset()
        self.warned = False

    def start(self) -> None:
        """Starts watching, unless it watches already or has warned."""
        with self._lock:
            if self.warned or (self._thread is not None and self._thread.is_alive()):
                return
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._watch, name="tf_diffmap-guard", daemon=True
            )
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> None:
        """One reading now (also called where training pauses, at a drain)."""
        if self.warned:
            return
        loss = self._latest_loss()
        if loss is None:
            return
        what = self.collapse.observe(loss)
        if what is not None:
            self.warned = True
            warnings.warn(
                f"Training is collapsing: {what}. {self._advice()}",
                UserWarning,
                stacklevel=2,
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
            if self.warned:
                return
