"""The state an asynchronous strategy's training shares while it runs.

`Runtime` holds what the strategy's `tf.distribute` hooks (`strategy.py`) and
the step feeds (`feed.py`) both use: the parameter store, the failure flag and
the first replica error waiting to be raised, the replicas' record, the
input built on the workers, and the feeds of the training steps traced so far.
It drains them (waits for every queued shard), raises a replica's error once,
and brings lost replicas back. It imports neither the strategy nor the feeds:
a feed registers itself here (`add_feed`), and the runtime sees it through the
`Feed` protocol. The replicas' record, the input built on the workers, and
the replicas that are lost, rejoin, join and leave are its base's,
`members.ReplicaMembers`; on one host that imports nothing of
`tf_diffmap.cluster` (the cluster's record of lost tasks and its input on
the workers are imported where a cluster needs them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import tensorflow as tf

from tf_diffmap.devices import inter_op_threads, local_cpu
from tf_diffmap.engine.guard import CollapseGuard
from tf_diffmap.engine.members import ReplicaMembers
from tf_diffmap.engine.replicas import WORKER_TIMEOUT
from tf_diffmap.engine.threads import in_clean_thread
from tf_diffmap.engine.windows import LATE_SHARDS, LATE_WINDOW, PATIENCE_MARGIN, WindowTimer
from tf_diffmap.engine.workers import POLL_SECONDS, ReplicaState
from tf_diffmap.store.gate import Gate
from tf_diffmap.store.parameter_store import ParameterStore
from tf_diffmap.store.snapshots import CounterSnapshots
from tf_diffmap.updates.aggregation import Aggregation
from tf_diffmap.updates.momentum import MomentumWatch
from tf_diffmap.updates.optimizer import AsyncOptimizer, find_in_chain

if TYPE_CHECKING:
    from tf_diffmap.cluster.inputs import WorkerInput

__all__ = ["Feed", "Runtime"]


class Feed(Protocol):
    """What the runtime asks of a training step's feed (`feed.StepFeed`)."""

    def running(self) -> bool: ...
    def in_worker(self) -> bool: ...
    def in_flight(self) -> int: ...
    def latest_loss(self) -> float | None: ...
    def wait_idle(self, failed) -> None: ...
    def stop(self) -> None: ...
    def mark_drained(self) -> None: ...
    def resync(self) -> None: ...
    def rejoin(self, replica_ids: Sequence[int]) -> None: ...
    def join(self, replica_ids: Sequence[int]) -> None: ...
    def leave(self, replica_ids: Sequence[int], timeout: float | None) -> list[int]: ...
    def states(self) -> list[ReplicaState]: ...
    def threads(self) -> list[threading.Thread]: ...
    def seconds_waited(self) -> list[float]: ...
    def queued(self) -> int: ...


class Runtime(ReplicaMembers):
    """What the strategy's hooks and its step feeds share.

    Args:
        replica_devices: the device of each replica.
        compute_devices: where each replica's ops run (`devices.compute_device`).
        parameter_devices: the devices of the parameter store.
        max_staleness: the Stale Synchronous Parallel bound, or None.
        queue_size: shards that may wait for a replica; None: two per replica.
        steps_per_loop: the most shards one call of a replica's loop applies.
        worker_timeout: seconds before a replica that holds the others up is
            treated as hung, or None.
        partitioner: what splits large variables (`partitioned`), or None.
        gradients_per_step: K, the shard gradients aggregated into one
            optimizer step (1: every shard's gradient is a step).
        max_step_staleness: with K > 1, the most optimizer steps a
            gradient's parameters may be behind and be accepted (None: any).
        ps_timeout: seconds without any update applied, while updates
            wait, before the parameter servers are probed and one that does
            not answer ends training with an error naming it, or None.
        absent_replicas: replica slots no worker holds yet (a cluster that
            grows, `tf_diffmap.cluster.membership`): every per-replica count
            has their rows, and they train once their worker joins.
        late_window: where windows are fresh (`max_step_staleness=0`), what
            the window timer does with a window open past its patience:
            `"fill"` it or `"close"` it short (`tf_diffmap.engine.windows`).
        patience_margin: the patience's margin over the median replica's
            read-to-push time.
        late_shards: `"requeue"` puts a shard whose gradient came too late
            for its fresh window back on the queue (one host); `"skip"`
            counts its examples as skipped.
    """

    def __init__(
        self,
        replica_devices: Sequence[str],
        compute_devices: Sequence[str],
        parameter_devices: Sequence[str],
        max_staleness: int | None,
        queue_size: int | None,
        steps_per_loop: int,
        worker_timeout: float | None,
        partitioner=None,
        gradients_per_step: int = 1,
        max_step_staleness: int | None = None,
        ps_timeout: float | None = None,
        absent_replicas: Sequence[int] = (),
        late_window: str = LATE_WINDOW,
        patience_margin: float = PATIENCE_MARGIN,
        late_shards: str = LATE_SHARDS,
    ):
        self.replica_devices = list(replica_devices)
        self.late_window = late_window
        self.late_shards = late_shards
        self.patience_margin = patience_margin
        # Per aggregation whose windows are fresh, its window timer.
        self._timers: dict[int, WindowTimer] = {}
        self._absent_at_start = list(absent_replicas)
        # Held while the workers' input is made or split anew, as workers
        # join, leave, rejoin, or a new `fit` distributes its dataset.
        self._members_lock = threading.RLock()
        self.gradients_per_step = gradients_per_step
        self.max_step_staleness = max_step_staleness
        # Per innermost optimizer (by id), its aggregation into steps; and
        # whether replicas may have pushed since the last flush.
        self._aggregations: dict[int, Aggregation] = {}
        self._pushed = False
        self.compute_devices = list(compute_devices)
        self.parameter_devices = list(parameter_devices)
        self.max_staleness = max_staleness
        self.queue_size = queue_size or 2 * len(self.replica_devices)
        self.steps_per_loop = steps_per_loop
        self.worker_timeout = worker_timeout
        self.ps_timeout = ps_timeout
        # Where Keras' graph runs (the chief on a cluster): the queue, the
        # outputs, the flags that Keras' graph reads, and the count of
        # completed steps live here.
        self.client_host = local_cpu()
        self.store = ParameterStore(
            self.parameter_devices,
            len(self.replica_devices),
            on_host_access=self._on_host_access,
            ledger_device=self.client_host,
            partitioner=partitioner,
        )
        # On a cluster: per replica, the CPU of its worker task, where its
        # input is built (`read_input_on_workers`).
        self.worker_hosts: list[str] | None = None
        self.worker_input: WorkerInput | None = None
        # The functions of inputs replaced while a worker was lost, held
        # until no worker is: dropped, each would be removed from every
        # remote task, the lost one included (a "Failed to remove function
        # remotely" error of the runtime).
        self._kept_functions: list = []
        # On a cluster, the functions of the latest evaluation's dataset
        # (`AsyncExtended._experimental_distribute_dataset`).
        self.inference_functions: list = []
        with tf.init_scope(), tf.device(self.client_host):
            # Set while a replica's error waits to be raised: the loops drop
            # what they take, and the input pipelines end.
            self.failed = tf.Variable(False, trainable=False, name="replica_failed")
        # Counter snapshots that Keras' graph takes while a batch-level
        # `StalenessTensorBoard` asks for them.
        self.snapshots = CounterSnapshots(self.store, self.client_host)
        self._feeds: list[Feed] = []
        self._error: BaseException | None = None
        self._error_lock = threading.Lock()
        # An op that waits for a worker holds one of TensorFlow's inter-op
        # threads while it waits; the workers' steps need another.
        self.graph_may_wait = inter_op_threads() >= 2
        self.momentum_watch = MomentumWatch(check_every=1)
        # The model's optimizer, as the latest training step saw it.
        self.model_optimizer = None
        self.guard = CollapseGuard(
            self._latest_loss, lambda: any(f.running() for f in self._feeds), self._advice
        )
        # What a replica's error means, and the replicas' record; on a
        # cluster also lost tasks, and the thread that brings a lost worker
        # back.
        self.record = self._new_record()
        # On a cluster that grows and shrinks, its worker slots and the
        # endpoint workers join and leave through (`cluster.membership`).
        self.membership = None

    # -- the feeds ---------------------------------------------------------

    def add_feed(self, feed: Feed) -> None:
        """A training step's feed, to drain and bring replicas back to."""
        self._feeds.append(feed)

    def feeds(self) -> list[Feed]:
        return list(self._feeds)

    def in_flight(self) -> int:
        """Shards queued or being applied, over every feed."""
        return sum(feed.in_flight() for feed in self._feeds)

    # -- aggregation -------------------------------------------------------

    @property
    def aggregates(self) -> bool:
        """Whether shard gradients are aggregated into optimizer steps."""
        return self.gradients_per_step > 1

    def aggregation_for(self, optimizer) -> Aggregation:
        """The aggregation of an (innermost) optimizer's steps, made once."""
        aggregation = self._aggregations.get(id(optimizer))
        if aggregation is None or aggregation.optimizer is not optimizer:
            replicas = len(self.replica_devices)
            # Made outside the strategy's scope: none of its variables is a
            # store variable, whose eager reads would drain.
            gate = in_clean_thread(
                lambda: Gate(self.store.host, replicas, events_host=self.client_host),
                name="tf_diffmap-gate",
            )
            aggregation = Aggregation(
                optimizer,
                self.store,
                self.gradients_per_step,
                self.max_step_staleness,
                replicas=replicas,
                gate=gate,
            )
            self._aggregations[id(optimizer)] = aggregation
            if aggregation.fresh:
                self._timers[id(optimizer)] = WindowTimer(
                    aggregation,
                    self.late_window,
                    self.patience_margin,
                    present=self._present_replicas,
                    may_fill=lambda: any(feed.queued() for feed in self.feeds()),
                    on_error=self._timer_failed,
                    store_lost=self.record.store_lost,
                    transient=self.may_call_again,
                )
        return aggregation

    def window_statistics(self):
        """The first aggregation's `WindowStats`, or None."""
        aggregations = self.aggregations()
        if not aggregations:
            return None
        first = aggregations[0]
        timer = self._timers.get(id(first.optimizer))
        return first.gate.statistics(timer.patience if timer is not None else None)

    def prepare_windows(self) -> None:
        """Runs the window timers' functions once while every task serves."""
        for aggregation in self.aggregations():
            if aggregation.fresh:
                aggregation.prepare()

    def timers(self) -> list[WindowTimer]:
        """The window timers of the aggregations whose windows are fresh."""
        return list(self._timers.values())

    def requeue_gate(self) -> Gate | None:
        """The gate of the fresh windows whose late shards go back on the
        queue, or None where their examples are skipped: `late_shards=
        "skip"`, a cluster (a queued item is a token there, which stands for
        whatever shard its taker's input yields next), or a step with more
        than one optimizer (a shard put back would train again the one
        whose window took it)."""
        fresh = [a for a in self.aggregations() if a.fresh]
        if self.late_shards != "requeue" or self.worker_hosts is not None or len(fresh) != 1:
            return None
        return fresh[0].gate

    def window_waits(self, replica_id: tf.Tensor) -> list[tf.Operation]:
        """Where windows are fresh, what a replica waits for before it
        takes a shard (in its loop's graph)."""
        waits = [a.wait_before_take(replica_id) for a in self.aggregations()]
        return [wait for wait in waits if wait is not None]

    def window_targets(self, examples: tf.Tensor) -> list[tf.Operation]:
        """A batch of `examples` is queued: where windows are fresh, a full
        window holds at least as many (in Keras' graph)."""
        return [
            aggregation.gate.set_target(examples)
            for aggregation in self.aggregations()
            if aggregation.fresh
        ]

    def _present_replicas(self) -> list[int]:
        """The replicas a fresh window waits for: not absent, lost, or
        leaving (a leaving replica pushes nothing more)."""
        absent = set(self.absent_replicas())
        states = [feed.states() for feed in self.feeds()]
        gone = (ReplicaState.LOST, ReplicaState.LEAVING)
        return [
            r
            for r in range(len(self.replica_devices))
            if r not in absent and all(s[r] not in gone for s in states)
        ]

    def store_call(self, call: Callable[[], object]) -> object:
        """Makes a call to the store from outside the replicas' loops, and
        makes it again while `may_call_again` lets its error pass (made as a
        worker dies, a call to the ps can fail naming it, or naming another
        lost at once). Any other error is raised."""
        failing_since = None
        while True:
            try:
                return call()
            except tf.errors.OpError as error:
                failing_since = failing_since or time.monotonic()
                if not self.may_call_again(error, failing_since):
                    raise
            time.sleep(POLL_SECONDS)

    def may_call_again(self, error: BaseException, failing_since: float) -> bool:
        """Whether a store call made outside the replicas' loops (the window
        timer's, `store_call`'s), failing with `error` since `failing_since`
        (`time.monotonic()`), is made again: while the record lets the error
        pass (`ReplicaRecord.transient_store_error`: on a cluster any but a
        lost ps's; on one host none), for at most `worker_timeout` of
        failing (`WORKER_TIMEOUT` where it is None). A worker's loss,
        restart or join settles within that; a call that fails for longer
        fails for good, and its error ends training."""
        limit = WORKER_TIMEOUT if self.worker_timeout is None else self.worker_timeout
        if time.monotonic() - failing_since >= limit:
            return False
        return self.record.transient_store_error(error)

    def recheck_windows(self) -> None:
        """A replica's call was cut off, or replicas were lost: each window
        timer looks at the window open now (`WindowTimer.recheck`)."""
        for timer in self.timers():
            timer.recheck()

    def _timer_failed(self, error: BaseException) -> None:
        error = self.record.store_error(error)
        with self._error_lock:
            if self._error is None:
                self._error = error
        self.failed.assign(True)

    def _stop_timers(self) -> None:
        for timer in self.timers():
            timer.stop()

    def aggregations(self) -> list[Aggregation]:
        return list(self._aggregations.values())

    def training_started(self) -> None:
        """Replicas start applying shards (a feed starts its loops)."""
        self._pushed = True
        self.guard.start()
        for timer in self.timers():
            timer.start()

    def watch_optimizer(self, optimizer) -> None:
        """The optimizer of a model whose training step is traced."""
        if optimizer is not self.model_optimizer:
            self.model_optimizer = optimizer
            self.guard.reset()
        self.momentum_watch.watch(optimizer)

    def _latest_loss(self) -> float | None:
        losses = [loss for feed in self._feeds if (loss := feed.latest_loss()) is not None]
        return losses[-1] if losses else None

    def _advice(self) -> str:
        """The store's mode, the staleness and what to try (for the guard)."""
        stats = self.store.statistics()
        staleness = (
            f"mean staleness {stats.overall_mean_staleness:.1f} versions "
            f"(max {stats.overall_max_staleness})"
        )
        if self.aggregates:
            bound = self.max_step_staleness
            return (
                f"The store aggregates {self.gradients_per_step} shard gradients into each "
                f"step of the optimizer ({staleness}, "
                f"{stats.overall_mean_step_staleness:.2f} optimizer steps, max "
                f"{stats.overall_max_step_staleness}; max_step_staleness={bound}), so the "
                "optimizer takes the steps of synchronous training on the whole batch. Try "
                "a lower learning rate (half the one tuned for synchronous training held "
                "best on tf_diffmap's grid of conditions): at this one the optimizer may run "
                "near its stability limit even in synchronous training"
                + (
                    "; and take steps of fresh gradients only with "
                    "Strategy(max_step_staleness=0), the default."
                    if bound is None or bound > 0
                    else "."
                )
            )
        wrapper = find_in_chain(self.model_optimizer, AsyncOptimizer)
        rule = f'AsyncOptimizer rule "{wrapper.rule}"' if wrapper is not None else "no rule"
        return (
            f"Every shard's gradient is a step of its own here (gradients_per_step=1, "
            f"{rule}; {staleness}): each replica's step is taken on a fraction of the "
            "batch with the learning rate tuned for the whole batch. Leave the default, "
            'Strategy(gradients_per_step="auto"), under which the optimizer takes one step '
            "per batch, the steps it was tuned for."
        )

    def flush_aggregations(self) -> int:
        """Applies every partial window (no replica may be running), if
        replicas ran since the last flush.

        Returns:
            The pushes applied.
        """
        if not self._pushed:
            return 0
        self._pushed = False
        return sum(aggregation.flush() for aggregation in self.aggregations())

    # -- drain and errors ---------------------------------------------------

    def _on_host_access(self) -> None:
        if any(feed.in_worker() for feed in self._feeds):
            return
        self.drain()

    def drain(self) -> None:
        """Waits for every queued shard, stops the loops, raises an error."""
        drained = False
        for feed in self.feeds():
            if feed.running() or feed.in_flight():
                feed.wait_idle(failed=lambda: self._error is not None)
                # Nothing is queued or being applied: a fresh window still
                # open holds every push it will get, and the replicas that
                # pushed into it wait for its close before they can take
                # their STOP. It is applied now, not at the window timer's
                # patience (or never, where a call cut off before it told
                # the timer of the window).
                if self._error is None and not self.record.store_lost():
                    for aggregation in self.aggregations():
                        if aggregation.fresh:
                            aggregation.flush()
                feed.stop()
                feed.mark_drained()
                drained = True
        # No replica waits now: what a window holds is the drain's to apply.
        self._stop_timers()
        if self._error is None and not self.record.store_lost():
            # What is read is what was trained: a window that is not full
            # is applied as it is.
            self.flush_aggregations()
            self.guard.check(read=drained)
        self.raise_error()
        if drained:
            # Nothing in flight: a claim that never completed was abandoned
            # (its step was interrupted by a lost worker).
            self.store.settle_abandoned()
            # Once per stretch of training: is momentum adding up past 1?
            self.momentum_watch.check(self.store.statistics)

    def drain_from_graph(self) -> None:
        """A drain asked for by a step in a graph (evaluate, predict)."""
        in_flight = self.in_flight()
        if in_flight and not self.graph_may_wait:
            raise RuntimeError(
                f"A step that reads the whole model runs while {in_flight} "
                "replica steps are still queued or running, and TensorFlow has a "
                "single inter-op thread: waiting for them inside this step would "
                "hold the thread they need. Call `strategy.drain()` before this "
                "step, or give TensorFlow two or more inter-op threads "
                "(`tf.config.threading.set_inter_op_parallelism_threads(2)` "
                "before anything runs)."
            )
        self.drain()

    def raise_error(self) -> None:
        """Raises, once, the first error of a replica (after stopping all loops)."""
        if self._error is None:
            return
        for feed in self.feeds():
            feed.stop()  # The failure flag is still set: they drop what is left.
            feed.resync()
            feed.mark_drained()
        # A failed step may have claimed a version without completing it.
        if not self.record.store_lost():
            self.store.settle_abandoned()
        with self._error_lock:
            error, self._error = self._error, None
        self.failed.assign(False)
        if error is not None:
            self.snapshots.stop()  # the fit fails: its callbacks read no more
            raise error

    def replica_failed(self, replica_id: int, error: BaseException) -> ReplicaState:
        """A replica's loop raised (called from its thread): its next state.

        A lost worker's replicas are LOST and the others go on; anything
        fatal is kept to be raised, and the failure flag ends the input.
        """
        state, raised = self.record.verdict(replica_id, error)
        if state != "failed":
            # Lost or going on, its call has ended, cut off: a window its
            # step had taken and not settled would hold the others' waits
            # for ever, and a window it opened may never have been told to
            # the timer.
            for aggregation in self.aggregations():
                if aggregation.fresh:
                    self.store_call(lambda a=aggregation: a.settle_cut_off(replica_id))
            self.recheck_windows()
            return ReplicaState(state)
        with self._error_lock:
            if self._error is None:
                self._error = raised
        self.failed.assign(True)
        return ReplicaState.FAILED

    def shutdown(self) -> None:
        """Drops queued shards and stops every thread now."""
        self.failed.assign(True)  # The loops drop what is still queued.
        try:
            self.record.stop()
            for feed in self.feeds():
                feed.stop()
                feed.mark_drained()
            self._stop_timers()
        finally:
            if self._error is None:
                self.failed.assign(False)

    def training(self) -> bool:
        """Whether replicas' loops run now."""
        return any(feed.running() for feed in self._feeds)

    def stalled(self, seconds: float) -> bool:
        """No update applied for `seconds` while updates wait: fatal if the
        record finds a parameter server that does not answer (its error is
        kept to be raised, and the input ends)."""
        raised = self.record.stalled(seconds)
        if raised is None:
            return False
        with self._error_lock:
            if self._error is None:
                self._error = raised
        self.failed.assign(True)
        return True

    def threads(self) -> list[threading.Thread]:
        """The loops' threads and the record's (the rejoiner's), alive now."""
        loops = [t for feed in self.feeds() for t in feed.threads()]
        return loops + self.record.threads()

    def seconds_held_back(self) -> list[float]:
        """Per replica, the time `max_staleness` kept it waiting for others."""
        waited = [0.0] * len(self.replica_devices)
        for feed in self.feeds():
            waited = [a + b for a, b in zip(waited, feed.seconds_waited())]
        return waited
