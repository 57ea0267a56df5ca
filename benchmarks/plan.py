"""What a run measures: the full, quick and smoke presets, and the sessions they make.

A *session* is one subprocess: one contender on one number of logical CPU
devices, running a list of tasks (see `benchmarks.worker`). The suite runs
every session of a plan once per repeat, in the same order each round, so
that the contenders alternate (A B C A B C ...) and slow drifts of a shared
machine fall on all of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = [
    "Plan",
    "PRESETS",
    "WORKLOADS",
    "CLUSTER_CONTENDERS",
    "EXTRA_CLUSTER_CONTENDERS",
    "AGGREGATED_RULES",
    "SPLIT_BATCH_CONTENDERS",
    "sessions",
    "steps_per_epoch",
    "timed_task",
]

# What a plan can measure; `Plan.workloads` (and `--only`) picks among them.
WORKLOADS = (
    "throughput",
    "straggler",
    "accuracy",
    "points",
    "control",
    "cluster",
    "fault_timeline",
    "embeddings",
)

# Contenders that only the cluster workload runs (each brings its own cluster).
CLUSTER_CONTENDERS = ("tf_diffmap_cluster", "tf_diffmap_cluster_async", "parameter_server")

# The `AsyncOptimizer` rules that change a step where the store aggregates
# the shards' gradients into steps (tf_diffmap's default): "drop" decides per
# push. The per-update rules ("inverse", "dc", ...) change each shard's own
# update, and run on `tf_diffmap_per_shard` (`gradients_per_step=1`).
AGGREGATED_RULES = ("drop",)

# Cluster contenders that no preset runs, run when `--contenders` names them.
EXTRA_CLUSTER_CONTENDERS = ("tf_diffmap_cluster_async",)

# Cluster contenders whose step splits the global batch over the workers (one
# update per worker on `batch_size / workers` examples), as tf_diffmap does.
SPLIT_BATCH_CONTENDERS = ("tf_diffmap_cluster", "tf_diffmap_cluster_async")


@dataclasses.dataclass(frozen=True)
class Plan:
    """Settings of one benchmark run; each field's comment says what it sets.

    Every session runs once per round (`repeats`) and the report takes
    medians over the rounds. "There" means the workload of the field's prefix.
    """

    name: str  # the preset's name
    repeats: int  # rounds
    contenders: tuple[str, ...] = (  # a subset of `CONTENDERS`
        "plain_keras",
        "mirrored",
        "tf_diffmap",
        "tf_diffmap_per_shard",
        "tf_diffmap_bounded",
        "central_storage",
    )
    replicas: tuple[int, ...] = (1, 2, 4)  # device counts of throughput (1: the overhead)
    # The contenders run on 1 device (None: all): there the synchronous
    # strategies have nothing to synchronize, and plain Keras is their reference.
    one_device_contenders: tuple[str, ...] | None = ("plain_keras", "tf_diffmap")
    models: tuple[str, ...] = ("mlp", "cnn")  # models of the throughput workload
    # Device counts where the MLP also gets NumPy arrays in `fit` (a new input
    # iterator every epoch, which a multi-device strategy pays for).
    numpy_input_replicas: tuple[int, ...] = (1, 4)
    straggler_replicas: tuple[int, ...] = (2, 4)
    slowdowns: tuple[int, ...] = (1, 2, 4)  # replica 0 k times slower; 1 is the reference
    straggler_model: str = "mlp"
    accuracy_replicas: int = 4  # time to accuracy on digits: its device count,
    accuracy_slowdown: int = 4  # the straggler's slowdown,
    accuracy_epochs: int = 16  # the budget of epochs,
    # AsyncOptimizer rules of tf_diffmap_per_shard; tf_diffmap runs its default
    # step, and each of these that applies to it (`AGGREGATED_RULES`),
    accuracy_rules: tuple[str, ...] = ("none", "inverse", "dc", "drop")
    accuracy_references: bool = True  # MirroredStrategy and tf_diffmap without the straggler too,
    accuracy_contenders: tuple[str, ...] | None = None  # its contenders (None: all),
    accuracy_targets: tuple[float, ...] = (0.95, 0.97)  # and the accuracies timed
    batch_size: int = 128  # global batch of every contender
    learning_rate: float = 1e-3  # Adam's, for every contender
    examples_per_epoch: dict[str, int] = dataclasses.field(
        default_factory=lambda: {"mlp": 2048, "cnn": 2048}
    )
    min_epochs: int = 3  # a timed window lasts at least this many epochs
    min_seconds: float = 2.0  # and this many seconds
    max_staleness: int = 4  # the bound of tf_diffmap_bounded
    drop_above: int = 8  # the bound of the "drop" rule
    # The straggler's unit of delay: None measures it (a MirroredStrategy step
    # per device count, before the rounds); a number skips that calibration.
    step_seconds: float | None = None
    # The cost of `StalenessTensorBoard(update_freq="batch")` (tf_diffmap): its
    # device count (None: not run), batch, epochs per `fit` and rounds.
    points_replicas: int | None = 4
    points_batch_size: int = 64
    points_epochs: int = 3
    points_rounds: int = 3
    seed: int = 0  # seeds data, weights and shuffling
    workloads: tuple[str, ...] = WORKLOADS  # which of `WORKLOADS` run
    # Plain Keras on one device; tf_diffmap on `control_replicas` devices, and
    # with each replica's ops on its own device (as GPU replicas are).
    control_contenders: tuple[str, ...] = ("plain_keras", "tf_diffmap", "tf_diffmap_own_devices")
    control_replicas: int = 4
    control_batch_size: int = 16  # a shard of batch / replicas examples per update
    control_learning_rate: float = 0.01  # SGD's
    control_steps_per_epoch: int = 512  # a multiple of every steps_per_execution
    control_steps_per_execution: tuple[int, ...] = (16, 1)  # a timed window each
    control_steps_per_loop: tuple[int, ...] = (32, 1)  # tf_diffmap's K: a session each
    control_min_epochs: int = 3
    control_min_seconds: float = 2.0
    # tf_diffmap on a localhost cluster and with the same replicas in one
    # process; tf-keras' ParameterServerStrategy on a cluster of its own.
    cluster_contenders: tuple[str, ...] = ("tf_diffmap_cluster", "tf_diffmap", "parameter_server")
    cluster_workers: int = 2  # one replica each; the in-process reference's devices
    cluster_ps: int = 1
    cluster_model: str = "mlp_wide"  # a key of `workloads.MODELS`
    cluster_batch_size: int = 128
    # Also tf_diffmap on the cluster at `cluster_batch_size` per worker: each
    # update then trains as many examples as a ParameterServerStrategy step.
    cluster_update_batch_row: bool = True
    cluster_examples_per_epoch: int = 4096
    cluster_min_epochs: int = 3
    cluster_min_seconds: float = 3.0
    # The fault timeline: the cluster workload's model on `fault_workers`
    # workers and `fault_ps` ps tasks; worker `fault_worker` is killed
    # (SIGKILL) at `fault_kill_at` s into a `fit` of `fault_seconds` and
    # started again at its address at `fault_restart_at`. The counters are read
    # every `fault_sample_seconds` into bins of `fault_bin_seconds`; the rates
    # skip `fault_warmup_seconds` at the start and `fault_settle_seconds` after
    # the rejoin; `fault_full_rate` of the rate before counts as the full rate.
    fault_workers: int = 3
    fault_ps: int = 1
    fault_worker: int = 2
    fault_seconds: float = 120.0
    fault_kill_at: float = 15.0
    fault_restart_at: float = 30.0
    fault_sample_seconds: float = 0.25
    fault_bin_seconds: float = 1.0
    fault_warmup_seconds: float = 3.0
    fault_settle_seconds: float = 2.0
    fault_full_rate: float = 0.95
    # The bag of ids: plain Keras on one device, tf_diffmap on
    # `embedding_replicas`, at each table size (smallest first) and optimizer
    # (keys of `workloads.EMBEDDING_OPTIMIZERS`); the first epoch not timed.
    embedding_contenders: tuple[str, ...] = ("plain_keras", "tf_diffmap")
    embedding_replicas: int = 4
    embedding_rows: tuple[int, ...] = (40_000, 400_000)
    embedding_optimizers: tuple[str, ...] = ("sgd", "adagrad", "adam")
    embedding_batch_size: int = 256
    embedding_examples_per_epoch: int = 16384
    embedding_epochs: int = 10
    # The same on a localhost cluster, the table split over the ps tasks
    # (`embedding_cluster_rows` None: not run). ParameterServerStrategy trains
    # SGD with tf-keras' legacy SGD, whose sparse update touches rows only.
    embedding_cluster_contenders: tuple[str, ...] = ("tf_diffmap_cluster", "parameter_server")
    embedding_cluster_workers: int = 2
    embedding_cluster_ps: int = 2
    embedding_cluster_rows: int | None = 1_000_000
    embedding_cluster_optimizers: tuple[str, ...] = ("sgd", "adagrad")
    embedding_cluster_epochs: int = 4

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PRESETS = {
    # 25 minutes on a 2-core host, and about 8 more for the fault timeline's three
    # runs of 120 s (`--repeats 2` for about two thirds of that).
    "full": Plan(name="full", repeats=3),
    # About 7 minutes on a 2-core host: 4 replicas (and 1 for the overhead),
    # MLP only, tf.data input only, 2 repeats; and 3 more for two fault timelines
    # of 60 s.
    "quick": Plan(
        name="quick",
        repeats=2,
        replicas=(1, 4),
        models=("mlp",),
        numpy_input_replicas=(),
        straggler_replicas=(4,),
        slowdowns=(1, 4),
        accuracy_epochs=12,
        accuracy_rules=("none", "inverse", "dc", "drop"),
        accuracy_references=False,
        accuracy_contenders=(
            "plain_keras",
            "mirrored",
            "tf_diffmap",
            "tf_diffmap_requeue",
            "tf_diffmap_async_windows",
            "tf_diffmap_per_shard",
        ),
        min_epochs=3,
        min_seconds=1.0,
        control_steps_per_epoch=256,
        control_min_seconds=1.0,
        cluster_examples_per_epoch=2048,
        cluster_min_seconds=1.5,
        fault_seconds=60.0,
        fault_kill_at=10.0,
        fault_restart_at=20.0,
        embedding_optimizers=("sgd", "adam"),
        embedding_epochs=6,
        embedding_cluster_optimizers=("adagrad",),
        embedding_cluster_epochs=3,
    ),
    # Three sessions of seconds each, for the test suite: its numbers mean nothing.
    "smoke": Plan(
        name="smoke",
        repeats=1,
        contenders=("plain_keras", "tf_diffmap", "tf_diffmap_per_shard"),
        replicas=(1,),
        one_device_contenders=("plain_keras",),
        models=("mlp",),
        numpy_input_replicas=(),
        straggler_replicas=(2,),
        slowdowns=(1, 2),
        accuracy_replicas=2,
        accuracy_slowdown=2,
        accuracy_epochs=1,
        accuracy_rules=("inverse",),
        accuracy_references=False,
        examples_per_epoch={"mlp": 512, "cnn": 256},
        min_epochs=1,
        min_seconds=0.0,
        step_seconds=0.002,
        points_replicas=2,
        points_epochs=1,
        points_rounds=1,
        # Their own smoke tests run control, cluster, fault_timeline and
        # embeddings (`--only ...`).
        workloads=("throughput", "straggler", "accuracy", "points"),
        control_steps_per_epoch=32,
        control_steps_per_loop=(32,),
        control_min_epochs=1,
        control_min_seconds=0.0,
        cluster_examples_per_epoch=512,
        cluster_min_epochs=1,
        cluster_min_seconds=0.0,
        fault_seconds=20.0,
        fault_kill_at=4.0,
        fault_restart_at=7.0,
        fault_warmup_seconds=1.0,
        embedding_rows=(2_000, 20_000),
        embedding_optimizers=("sgd",),
        embedding_examples_per_epoch=1024,
        embedding_epochs=2,
        embedding_cluster_rows=None,
    ),
}


def with_cluster_model(plan: Plan, model: str) -> Plan:
    """`plan` with the cluster workloads on `model` (a key of `workloads.MODELS`)."""
    from benchmarks.workloads import MODELS

    if model not in MODELS:
        raise ValueError(f"Unknown model {model!r}; expected one of {sorted(MODELS)}.")
    return dataclasses.replace(plan, cluster_model=model)


def steps_per_epoch(plan: Plan, model: str) -> int:
    return math.ceil(plan.examples_per_epoch[model] / plan.batch_size)


def timed_task(plan: Plan, model: str) -> dict[str, Any]:
    """The settings every timed window of `model` shares."""
    return {
        "model": model,
        "batch_size": plan.batch_size,
        "learning_rate": plan.learning_rate,
        "examples_per_epoch": plan.examples_per_epoch[model],
        "min_epochs": plan.min_epochs,
        "min_seconds": plan.min_seconds,
    }


def _accuracy(plan: Plan, delay: float, rule: str | None, straggler: bool) -> dict[str, Any]:
    return {
        "kind": "accuracy",
        "batch_size": plan.batch_size,
        "learning_rate": plan.learning_rate,
        "epochs": plan.accuracy_epochs,
        "targets": list(plan.accuracy_targets),
        "rule": rule,
        "drop_above": plan.drop_above if rule == "drop" else None,
        "delay": delay if straggler else 0.0,
        "straggler": straggler,
    }


def sessions(plan: Plan, delays: dict[int, dict[int, float]]) -> list[dict[str, Any]]:
    """The sessions of one round, grouped by device count.

    Args:
        plan: the plan.
        delays: per device count, per slowdown k, replica 0's sleep per step
            in seconds (from the calibration).

    Returns:
        Session configurations for `benchmarks.worker`, in running order.
    """
    counts: set[int] = set()
    if "throughput" in plan.workloads:
        counts |= set(plan.replicas)
    if "straggler" in plan.workloads:
        counts |= set(plan.straggler_replicas)
    if "accuracy" in plan.workloads:
        counts.add(plan.accuracy_replicas)
        if "plain_keras" in plan.contenders:
            counts.add(1)  # its time-to-accuracy reference
    points = (
        "points" in plan.workloads
        and plan.points_replicas is not None
        and "tf_diffmap" in plan.contenders
    )
    if points:
        counts.add(plan.points_replicas)
    out = []
    for replicas in sorted(counts):
        for contender in plan.contenders:
            if contender in CLUSTER_CONTENDERS:
                continue
            if contender == "plain_keras" and replicas != 1:
                continue
            if replicas == 1 and contender in ("tf_diffmap_bounded", "tf_diffmap_per_shard"):
                continue  # one replica: K = 1, a step per shard, and nothing to bound
            if (
                replicas == 1
                and plan.one_device_contenders is not None
                and contender not in plan.one_device_contenders
            ):
                continue
            tasks: list[dict[str, Any]] = []
            throughput = "throughput" in plan.workloads
            if throughput and replicas in plan.replicas:
                tasks += [{"kind": "throughput", **timed_task(plan, m)} for m in plan.models]
            if throughput and replicas in plan.numpy_input_replicas and "mlp" in plan.models:
                tasks.append({"kind": "throughput", **timed_task(plan, "mlp"), "input": "numpy"})
            if (
                "straggler" in plan.workloads
                and replicas in plan.straggler_replicas
                and replicas in delays
            ):
                tasks.append(
                    {
                        "kind": "straggler",
                        **timed_task(plan, plan.straggler_model),
                        "delays": {str(k): delays[replicas][k] for k in plan.slowdowns},
                    }
                )
            if "accuracy" in plan.workloads:
                tasks += _accuracy_tasks(plan, contender, replicas, delays)
            if points and contender == "tf_diffmap" and replicas == plan.points_replicas:
                tasks.append(
                    {
                        "kind": "points",
                        "batch_size": plan.points_batch_size,
                        "learning_rate": plan.learning_rate,
                        "epochs": plan.points_epochs,
                        "rounds": plan.points_rounds,
                    }
                )
            if tasks:
                out.append(
                    {
                        "contender": contender,
                        "replicas": replicas,
                        "max_staleness": plan.max_staleness
                        if contender == "tf_diffmap_bounded"
                        else None,
                        "seed": plan.seed,
                        "tasks": tasks,
                    }
                )
    if "control" in plan.workloads:
        out += _control_sessions(plan)
    if "cluster" in plan.workloads:
        out += _cluster_sessions(plan)
    if "fault_timeline" in plan.workloads:
        out.append(_fault_timeline_session(plan))
    if "embeddings" in plan.workloads:
        out += _embedding_sessions(plan)
    return out


def _embedding_sessions(plan: Plan) -> list[dict[str, Any]]:
    """Per table size, plain Keras on one device then tf_diffmap, each
    training the bag of ids once with every optimizer."""
    out = []
    for rows in plan.embedding_rows:
        tasks = [
            {
                "kind": "embeddings",
                "rows": rows,
                "optimizer": optimizer,
                "batch_size": plan.embedding_batch_size,
                "examples_per_epoch": plan.embedding_examples_per_epoch,
                "epochs": plan.embedding_epochs,
            }
            for optimizer in plan.embedding_optimizers
        ]
        for contender in plan.embedding_contenders:
            replicas = 1 if contender == "plain_keras" else plan.embedding_replicas
            out.append(
                {"contender": contender, "replicas": replicas, "seed": plan.seed, "tasks": tasks}
            )
    if plan.embedding_cluster_rows is None:
        return out
    workers = plan.embedding_cluster_workers
    for contender in plan.embedding_cluster_contenders:
        # As many examples in each update: a ParameterServerStrategy step
        # trains a global batch on one worker, a tf_diffmap update its share.
        splits = contender in SPLIT_BATCH_CONTENDERS
        tasks = [
            {
                "kind": "embeddings",
                "rows": plan.embedding_cluster_rows,
                "optimizer": optimizer,
                "batch_size": plan.embedding_batch_size * (workers if splits else 1),
                "examples_per_update": plan.embedding_batch_size,
                "examples_per_epoch": plan.embedding_examples_per_epoch,
                "epochs": plan.embedding_cluster_epochs,
            }
            for optimizer in plan.embedding_cluster_optimizers
        ]
        out.append(
            {
                "contender": contender,
                "replicas": workers,
                "cluster": {"workers": workers, "ps": plan.embedding_cluster_ps, "split": True},
                "seed": plan.seed,
                "tasks": tasks,
            }
        )
    return out


def _control_sessions(plan: Plan) -> list[dict[str, Any]]:
    """Plain Keras on one device; tf_diffmap on `control_replicas`, once per K.

    Every session times one window per `steps_per_execution`.
    """
    tasks = [
        {
            "kind": "control",
            "steps_per_execution": n,
            "batch_size": plan.control_batch_size,
            "learning_rate": plan.control_learning_rate,
            "steps_per_epoch": plan.control_steps_per_epoch,
            "min_epochs": plan.control_min_epochs,
            "min_seconds": plan.control_min_seconds,
        }
        for n in plan.control_steps_per_execution
    ]
    out = []
    for contender in plan.control_contenders:
        if contender == "plain_keras":
            out.append({"contender": contender, "replicas": 1, "seed": plan.seed, "tasks": tasks})
        elif contender in ("tf_diffmap", "tf_diffmap_own_devices"):
            # Each replica on its own device: at the first K only, beside
            # the default placement's row.
            ks = plan.control_steps_per_loop
            out += [
                {
                    "contender": contender,
                    "replicas": plan.control_replicas,
                    "steps_per_loop": k,
                    "seed": plan.seed,
                    "tasks": tasks,
                }
                for k in (ks if contender == "tf_diffmap" else ks[:1])
            ]
    return out


def _cluster_sessions(plan: Plan) -> list[dict[str, Any]]:
    """The same workload on a localhost cluster, in one process and under PSS;
    and tf_diffmap on the cluster with PSS' examples per update, right after
    its own row."""
    task = {
        "kind": "cluster",
        "model": plan.cluster_model,
        "batch_size": plan.cluster_batch_size,
        "learning_rate": plan.learning_rate,
        "examples_per_epoch": plan.cluster_examples_per_epoch,
        "min_epochs": plan.cluster_min_epochs,
        "min_seconds": plan.cluster_min_seconds,
    }
    per_update = {**task, "batch_size": plan.cluster_batch_size * plan.cluster_workers}
    runs = []
    for contender in plan.cluster_contenders:
        runs.append((contender, task))
        if plan.cluster_update_batch_row and contender in SPLIT_BATCH_CONTENDERS:
            runs.append((contender, per_update))
    return [
        {
            "contender": contender,
            "replicas": plan.cluster_workers,
            "cluster": {"workers": plan.cluster_workers, "ps": plan.cluster_ps}
            if contender in CLUSTER_CONTENDERS
            else None,
            "seed": plan.seed,
            "tasks": [task],
        }
        for contender, task in runs
    ]


def _fault_timeline_session(plan: Plan) -> dict[str, Any]:
    """tf_diffmap on a localhost cluster, one of whose workers is killed and restarted."""
    return {
        "contender": "tf_diffmap_cluster",
        "replicas": plan.fault_workers,
        "cluster": {"workers": plan.fault_workers, "ps": plan.fault_ps},
        "seed": plan.seed,
        "tasks": [
            {
                "kind": "fault_timeline",
                "model": plan.cluster_model,
                "batch_size": plan.cluster_batch_size,
                "learning_rate": plan.learning_rate,
                "examples_per_epoch": plan.cluster_examples_per_epoch,
                "worker": plan.fault_worker,
                "seconds": plan.fault_seconds,
                "kill_at": plan.fault_kill_at,
                "restart_at": plan.fault_restart_at,
                "sample_seconds": plan.fault_sample_seconds,
                "bin_seconds": plan.fault_bin_seconds,
                "warmup_seconds": plan.fault_warmup_seconds,
                "settle_seconds": plan.fault_settle_seconds,
                "full_rate": plan.fault_full_rate,
            }
        ],
    }


def _accuracy_tasks(plan, contender, replicas, delays) -> list[dict[str, Any]]:
    """The time-to-accuracy tasks of one contender's session.

    tf_diffmap's default runs its own step (rule None: the plain optimizer)
    and the rules of `accuracy_rules` that apply where the store aggregates;
    `tf_diffmap_per_shard` runs every rule of `accuracy_rules`, each an
    `AsyncOptimizer` on every shard's update.
    """
    if plan.accuracy_contenders is not None and contender not in plan.accuracy_contenders:
        return []
    if contender == "plain_keras":
        # The single-device reference, without a straggler.
        return [_accuracy(plan, 0.0, None, False)] if replicas == 1 else []
    if replicas != plan.accuracy_replicas or replicas not in delays:
        return []
    delay = delays[replicas][plan.accuracy_slowdown]
    if contender == "tf_diffmap":
        rules = [None] + [r for r in plan.accuracy_rules if r in AGGREGATED_RULES]
        tasks = [_accuracy(plan, delay, rule, True) for rule in rules]
        if plan.accuracy_references:
            tasks.append(_accuracy(plan, delay, None, False))
        return tasks
    if contender == "tf_diffmap_per_shard":
        return [_accuracy(plan, delay, rule, True) for rule in plan.accuracy_rules]
    tasks = [_accuracy(plan, delay, None, True)]
    if contender == "mirrored" and plan.accuracy_references:
        tasks.append(_accuracy(plan, delay, None, False))
    return tasks
