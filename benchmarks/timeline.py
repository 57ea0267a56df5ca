"""A fault timeline: examples/s per second of wall time while a worker is lost.

The `fault_timeline` workload trains on a localhost cluster for a fixed wall
time while a `FaultScript` kills one worker process (SIGKILL, through the
`LocalCluster` handle of that pid) at `kill_at` seconds and starts it again
at the same address at `restart_at`. Meanwhile a `Sampler` thread reads, every
`interval` seconds, what the strategy has counted (`strategy.statistics()`:
examples and updates per replica), each replica's state
(`strategy.replica_states()`) and the CPU time of every process of the
cluster (from `/proc`, where there is one).

The rest is arithmetic on those samples, pure and testable without a
cluster: `bins` turns cumulative counters into rates per bin of wall time,
and `summarize` reads the rate before the kill, during the outage, after the
rejoin, and how long each step of the worker's return took.

Nothing here imports TensorFlow.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = [
    "HOST",
    "OTHERS",
    "Sampler",
    "FaultScript",
    "cpu_per_work",
    "cpu_seconds",
    "processes_cpu_seconds",
    "host_cpu_seconds",
    "bins",
    "state_changes",
    "summarize",
    "tcp_bytes",
]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds of a process so far (every thread), or None.

    None where `/proc` is missing (not Linux) or the process is gone.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces; the rest follows ")".
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


_SOCKET_OWNER = re.compile(r"pid=(\d+)")
_SOCKET_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")


def tcp_bytes(pids: Sequence[int]) -> dict[int, dict[str, int]] | None:
    """Per process, the bytes its open TCP sockets have sent and received.

    Read from the kernel's counters of each established socket (`ss -tinp`:
    `bytes_acked`, `bytes_received`), so it counts what gRPC moved between
    the tasks of a localhost cluster, whichever side initiated it. Sockets
    closed in between are not counted; gRPC keeps its channels open. None
    where `ss` cannot be run.
    """
    try:
        listing = subprocess.run(
            ["ss", "-tinpH", "state", "established"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    totals = {pid: {"sent": 0, "received": 0} for pid in pids}
    owner = None
    for line in listing.splitlines():
        if "users:" in line:
            found = _SOCKET_OWNER.search(line)
            owner = int(found.group(1)) if found else None
        elif owner in totals:
            counters = dict(_SOCKET_COUNTER.findall(line))
            totals[owner]["sent"] += int(counters.get("bytes_acked", 0))
            totals[owner]["received"] += int(counters.get("bytes_received", 0))
            owner = None
    return totals


def processes_cpu_seconds(pids: Sequence[int]) -> float | None:
    """The CPU seconds the processes have used so far (every thread), or
    None where one cannot be read (no `/proc`, a process gone)."""
    readings = [cpu_seconds(pid) for pid in pids]
    return None if any(r is None for r in readings) else sum(readings)


def cpu_per_work(
    start: float | None, end: float | None, processes: int, updates: int, examples: int
) -> dict[str, float]:
    """What a timed window cost the host: the CPU its processes used between
    two readings of `processes_cpu_seconds`, per update and per 1,000
    examples trained, whichever process or core spent it (empty where a
    reading is missing or nothing was trained)."""
    if start is None or end is None or not updates or not examples:
        return {}
    cpu = end - start
    return {
        "cpu_processes": processes,
        "cpu_ms_per_update": 1000 * cpu / updates,
        "cpu_ms_per_1000_examples": 1e6 * cpu / examples,
    }


def host_cpu_seconds() -> float | None:
    """Busy CPU seconds of the whole host so far (every process), or None.

    From the first line of `/proc/stat`: all time but idle and iowait.
    """
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        return (sum(fields[:8]) - fields[3] - fields[4]) / _TICKS
    except (OSError, IndexError, ValueError):
        return None


# The names under which `Sampler` records the host's CPU time, and `bins`
# what the host's other processes (not the cluster's) used.
HOST = "host"
OTHERS = "other processes"


class Sampler:
    """A thread that samples the strategy's counters every `interval` seconds.

    Each sample is a dict: `t` (seconds since `start`), `examples` and
    `updates` (per replica, cumulative), `states` (per replica, the
    `replica_states()` state), `since` (per replica, when it last changed
    state because of a fault, in the same seconds, or None), `cpu` (process
    name to `[pid, cumulative CPU seconds]`, the seconds None for a process
    that is gone; `HOST` for the whole host, every process of it).

    Args:
        strategy: a `tf_diffmap.Strategy`.
        processes: returns the processes to sample now, name to pid (a
            restarted task has a new pid).
        interval: seconds between samples.
    """

    def __init__(
        self,
        strategy,
        processes: Callable[[], dict[str, int]],
        interval: float = 0.25,
    ):
        self._strategy = strategy
        self._processes = processes
        self._interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.start_time = 0.0
        self.wall_start = 0.0

    def start(self, start_time: float) -> Sampler:
        """Starts sampling; `start_time` (`time.monotonic()`) is t = 0."""
        self.start_time = start_time
        self.wall_start = time.time() - (time.monotonic() - start_time)
        self._thread = threading.Thread(target=self._run, name="benchmark-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[dict[str, Any]]:
        """Takes a last sample, stops the thread; returns the samples."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.samples

    def sample(self) -> None:
        stats = self._strategy.statistics()
        reports = self._strategy.replica_states()
        cpu = {name: [pid, cpu_seconds(pid)] for name, pid in self._processes().items()}
        cpu[HOST] = [0, host_cpu_seconds()]
        self.samples.append(
            {
                "t": time.monotonic() - self.start_time,
                "examples": [int(v) for v in stats.examples],
                "updates": [int(v) for v in stats.updates],
                "states": [r.state for r in reports],
                # When each replica last changed state because of a fault.
                "since": [None if r.since is None else r.since - self.wall_start for r in reports],
                "cpu": cpu,
            }
        )

    def _run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception as error:  # noqa: BLE001 - kept in the result, sampling goes on
                if len(self.errors) < 20:
                    self.errors.append(f"{type(error).__name__}: {error}"[:300])
            if self._stop.wait(self._interval):
                break
        try:
            self.sample()
        except Exception as error:  # noqa: BLE001
            self.errors.append(f"{type(error).__name__}: {error}"[:300])


class FaultScript:
    """Threads that kill a worker, restart it, and end training on time.

    At `kill_at` seconds it calls `kill()` (SIGKILL to the worker's pid), at
    `restart_at` `restart()` (which returns once the new server serves), and
    at `seconds`, from a thread of its own so that a slow restart does not
    hold it back, `finish()` (which tells `fit` to stop). Each event's time,
    in seconds since `start`, goes into `events`.

    Args:
        kill: kills the worker; returns the pid it killed.
        restart: starts the worker again at its address; returns the new pid
            once it serves.
        finish: ends training.
        kill_at: seconds after the start.
        restart_at: seconds after the start (after `kill_at`).
        seconds: seconds after the start (after `restart_at`).

    Raises:
        ValueError: the times are not in that order.
    """

    def __init__(
        self,
        kill: Callable[[], int],
        restart: Callable[[], int],
        finish: Callable[[], None],
        kill_at: float,
        restart_at: float,
        seconds: float,
    ):
        if not 0 < kill_at < restart_at < seconds:
            raise ValueError(
                "FaultScript needs 0 < kill_at < restart_at < seconds, received "
                f"kill_at={kill_at!r}, restart_at={restart_at!r}, seconds={seconds!r}."
            )
        self._kill, self._restart, self._finish = kill, restart, finish
        self._plan = (kill_at, restart_at, seconds)
        self._cancel = threading.Event()
        self._threads: list[threading.Thread] = []
        self.events: dict[str, Any] = {}
        self.error: str | None = None
        self.start_time = 0.0

    def start(self, start_time: float) -> FaultScript:
        """Starts the clock; `start_time` (`time.monotonic()`) is t = 0."""
        self.start_time = start_time
        self._threads = [
            threading.Thread(target=target, name=f"benchmark-{name}", daemon=True)
            for name, target in (("faults", self._faults), ("finish", self._finish_on_time))
        ]
        for thread in self._threads:
            thread.start()
        return self

    def cancel(self) -> None:
        """Skips the events still to come (training ended early)."""
        self._cancel.set()

    def join(self) -> None:
        """Waits for the threads (a restart under way runs to its end)."""
        for thread in self._threads:
            thread.join()

    def _now(self) -> float:
        return time.monotonic() - self.start_time

    def _wait_until(self, t: float) -> bool:
        return not self._cancel.wait(max(0.0, t - self._now()))

    def _faults(self) -> None:
        kill_at, restart_at, _ = self._plan
        try:
            if self._wait_until(kill_at):
                self.events["kill"] = self._now()
                self.events["killed_pid"] = self._kill()
            if self._wait_until(restart_at):
                self.events["restart"] = self._now()
                self.events["restarted_pid"] = self._restart()
                self.events["serving"] = self._now()
        except Exception as error:  # noqa: BLE001 - reported; training still ends on time
            self.error = f"{type(error).__name__}: {error}"[:2000]

    def _finish_on_time(self) -> None:
        if self._wait_until(self._plan[2]):
            self.events["finish"] = self._now()
            self._finish()


def state_changes(samples: Sequence[dict[str, Any]], replicas: Sequence[int]) -> dict[str, Any]:
    """When the given replicas were first marked lost, and then running again.

    Read from the samples' `states` and `since` (the strategy's own times of
    the changes, not the sampling times).

    Returns:
        `lost` and `rejoined` in seconds since the start (None if not seen),
        and `rejoining_seen` (whether a sample caught the rejoining state).
    """
    lost = rejoined = None
    rejoining = False
    for s in samples:
        for r in replicas:
            state, since = s["states"][r], s["since"][r]
            if state == "lost" and lost is None:
                lost = since if since is not None else s["t"]
            elif state == "rejoining":
                rejoining = True
            elif state == "running" and lost is not None and rejoined is None:
                rejoined = since if since is not None else s["t"]
    return {"lost": lost, "rejoined": rejoined, "rejoining_seen": rejoining}


def _interp(x: float, xs: Sequence[float], ys: Sequence[float]) -> float:
    """`ys` at `x`, linear between samples, held flat outside them."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    lo, hi = 0, len(xs) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid
        else:
            hi = mid
    span = xs[hi] - xs[lo]
    w = (x - xs[lo]) / span if span else 1.0
    return float(ys[lo]) + w * (float(ys[hi]) - float(ys[lo]))


def bins(samples: Sequence[dict[str, Any]], width: float = 1.0) -> list[dict[str, Any]]:
    """Rates per bin of wall time from cumulative samples.

    Bin k covers `[k * width, (k + 1) * width)`; the counters are read at its
    edges, linearly between the two nearest samples. Only bins that the
    samples cover entirely are returned.

    Args:
        samples: `Sampler.samples` (at least two).
        width: the bin's width in seconds.

    Returns:
        Per bin: `start`, `end`, `examples_per_second` (all replicas),
        `replica_examples_per_second` (per replica), `updates_per_second`,
        `cpu_cores` (per process: CPU seconds per second of wall time, None
        where the process was not there for the whole bin; `HOST` for the
        host, `OTHERS` for the host less the sampled processes).

    Example:
        >>> s = [{"t": 0.0, "examples": [0], "updates": [0], "cpu": {}},
        ...      {"t": 2.0, "examples": [200], "updates": [4], "cpu": {}}]
        >>> [b["examples_per_second"] for b in bins(s)]
        [100.0, 100.0]
    """
    if len(samples) < 2:
        return []
    ts = [s["t"] for s in samples]
    replicas = len(samples[0]["examples"])
    examples = [[s["examples"][r] for s in samples] for r in range(replicas)]
    updates = [sum(s["updates"]) for s in samples]
    names = list(dict.fromkeys(name for s in samples for name in s.get("cpu", {})))
    out = []
    k = max(0, int(-(-ts[0] // width)))  # the first bin that starts at or after ts[0]
    while (k + 1) * width <= ts[-1] + 1e-9:
        a, b = k * width, (k + 1) * width
        per_replica = [(_interp(b, ts, e) - _interp(a, ts, e)) / width for e in examples]
        cores = {name: _cores(samples, ts, name, a, b) for name in names}
        if cores.get(HOST) is not None:
            ours = sum(v for n, v in cores.items() if n != HOST and v is not None)
            cores[OTHERS] = max(0.0, cores[HOST] - ours)
        out.append(
            {
                "start": a,
                "end": b,
                "examples_per_second": sum(per_replica),
                "replica_examples_per_second": per_replica,
                "updates_per_second": (_interp(b, ts, updates) - _interp(a, ts, updates)) / width,
                "cpu_cores": cores,
            }
        )
        k += 1
    return out


def _cores(samples, ts, name: str, a: float, b: float) -> float | None:
    """CPU seconds per wall second of one process over `[a, b)`, or None.

    None unless the samples around the bin show the same process (a pid that
    did not change: a restarted task starts counting again) all along.
    """
    first = max((i for i, t in enumerate(ts) if t <= a), default=None)
    last = min((i for i, t in enumerate(ts) if t >= b), default=None)
    if first is None or last is None:
        return None
    seen = [samples[i]["cpu"].get(name) for i in range(first, last + 1)]
    if any(v is None or v[1] is None for v in seen) or len({v[0] for v in seen}) != 1:
        return None
    xs = ts[first : last + 1]
    ys = [v[1] for v in seen]
    return (_interp(b, xs, ys) - _interp(a, xs, ys)) / (b - a)


def _window(rows: Sequence[dict[str, Any]], start: float | None, end: float | None) -> list:
    if start is None or end is None:
        return []
    return [r for r in rows if r["start"] >= start - 1e-9 and r["end"] <= end + 1e-9]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _window_figures(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["examples_per_second"] for r in rows]
    names = list(dict.fromkeys(n for r in rows for n in r["cpu_cores"]))
    replicas = len(rows[0]["replica_examples_per_second"]) if rows else 0
    return {
        "bins": len(rows),
        "start": rows[0]["start"] if rows else None,
        "end": rows[-1]["end"] if rows else None,
        "examples_per_second": _mean(rates),
        "min_examples_per_second": min(rates) if rates else None,
        "bin_cv": statistics.pstdev(rates) / _mean(rates)
        if len(rates) > 1 and _mean(rates)
        else None,
        "replica_examples_per_second": [
            _mean(r["replica_examples_per_second"][i] for r in rows) for i in range(replicas)
        ],
        "cpu_cores": {n: _mean(r["cpu_cores"].get(n) for r in rows) for n in names},
    }


def summarize(
    rows: Sequence[dict[str, Any]],
    events: dict[str, Any],
    lost_replicas: Sequence[int],
    samples: Sequence[dict[str, Any]] = (),
    warmup: float = 5.0,
    settle: float = 2.0,
    full_rate: float = 0.95,
) -> dict[str, Any]:
    """What the timeline shows, in the windows between the events.

    Windows, in whole bins (seconds since training started):

    - *before*: from `warmup` to the kill;
    - *outage*: from the kill to the restart (the loss is noticed and the
      survivors take over within it: the transition is counted);
    - *restarting*: from the restart to the rejoin (the new server starts:
      it imports TensorFlow and connects, on the same cores);
    - *after*: from `settle` seconds after the rejoin to the end.

    Args:
        rows: `bins(...)`.
        events: the `FaultScript` events, and `lost` / `rejoined` (seconds:
            when the killed worker's replicas were marked lost and running
            again).
        lost_replicas: the killed worker's replicas.
        samples: the raw samples (for the rejoined worker's first update).
        warmup: seconds skipped at the start (the fit's own start-up).
        settle: seconds after the rejoin before the *after* window.
        full_rate: the share of the before-rate that counts as the full
            rate again, for `seconds_rejoin_to_full_rate` (the first whole bin
            after the rejoin at that rate; from the rejoin, since on a
            CPU-bound host the survivors alone may reach it).

    Returns:
        Per window its figures (mean examples/s, the slowest bin, per
        replica, CPU cores per process), the shares of the before-rate, and
        the delays of the worker's return.
    """
    kill, restart = events.get("kill"), events.get("restart")
    rejoined = events.get("rejoined")
    # Bins after the end of training hold the last drain, not training.
    end = events.get("finish", rows[-1]["end"] if rows else None)
    windows = {
        "before": _window(rows, warmup, kill),
        "outage": _window(rows, kill, restart),
        "restarting": _window(rows, restart, rejoined),
        "after": _window(rows, rejoined + settle if rejoined is not None else None, end),
    }
    figures = {name: _window_figures(w) for name, w in windows.items()}
    before = figures["before"]["examples_per_second"]

    def share(name):
        value = figures[name]["examples_per_second"]
        return value / before if value is not None and before else None

    first_full = None
    if rejoined is not None and before:
        for r in rows:
            if r["start"] >= rejoined and r["examples_per_second"] >= full_rate * before:
                first_full = r["end"]
                break
    first_update = None
    if rejoined is not None and samples:
        at_rejoin = None
        for s in samples:
            done = sum(s["updates"][r] for r in lost_replicas)
            if s["t"] < rejoined:
                at_rejoin = done
            elif at_rejoin is not None and done > at_rejoin:
                first_update = s["t"]
                break

    def since(a, b):
        return b - a if a is not None and b is not None else None

    return {
        "windows": figures,
        "before_examples_per_second": before,
        "outage_share": share("outage"),
        "restarting_share": share("restarting"),
        "after_share": share("after"),
        "seconds_kill_to_lost": since(kill, events.get("lost")),
        "seconds_restart_to_serving": since(restart, events.get("serving")),
        "seconds_serving_to_rejoin": since(events.get("serving"), rejoined),
        "seconds_restart_to_rejoin": since(restart, rejoined),
        "seconds_rejoin_to_first_update": since(rejoined, first_update),
        "seconds_rejoin_to_full_rate": since(rejoined, first_full),
        "full_rate": full_rate,
    }
