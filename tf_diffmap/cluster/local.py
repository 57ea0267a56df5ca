"""Several hosts on one machine: worker and ps servers as local processes.

`LocalCluster` starts one `python -m tf_diffmap.cluster` process per worker and
ps task on free ports of 127.0.0.1, waits until each serves, and stops exactly
the processes it started. The servers are forked from one launcher process
that imported TensorFlow once (`launcher`): a start or restart does not pay
TensorFlow's import again. The chief is not started: it is the process that
uses `resolver()` (or `tf_config("chief", 0)`) and runs `model.fit`.
`python -m tf_diffmap.cluster --local workers=2,ps=1` does the same in the
foreground until Ctrl-C or SIGTERM (`run_local`, in `foreground`).

Each server runs in a session of its own, so a Ctrl-C meant for the parent
does not reach it, and exits when its standard input closes, so it does not
outlive a parent that was killed without the chance to stop it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import tensorflow as tf

from tf_diffmap.cluster.launcher import Launcher, ServerProcess

__all__ = ["LocalCluster", "chief_resolver", "free_ports"]

SERVER_JOBS = ("worker", "ps")


@dataclass
class _Task:
    """One worker or ps task: its fixed address and its current server process."""

    job: str
    index: int
    address: str
    process: ServerProcess | subprocess.Popen | None = None
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    launches: int = 0
    killed: bool = False  # stopped on purpose by `kill`, not a failure
    joined: bool = False  # started by `join_worker`: asks the chief for its slot

    @property
    def name(self) -> str:
        return f"{self.job} {self.index}"

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def chief_resolver(
    spec: dict[str, list[str]],
) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
    """The cluster resolver of the chief task of the cluster `spec`."""
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(spec),
        # A master address that is not local is what makes
        # `tf.config.experimental_connect_to_cluster` connect at all.
        master=spec["chief"][0],
        task_type="chief",
        task_id=0,
        rpc_layer="grpc",
    )


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports of `host`.

    All sockets are bound before any is closed, so the ports are distinct.
    """
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: Path | None, chars: int = 2000) -> str:
    if path is None or not path.exists():
        return "(no output)"
    text = path.read_text(errors="replace").strip()
    return text[-chars:] if text else "(empty)"


class LocalCluster:
    """Worker and ps servers as processes of this machine, for trying a cluster.

    A context manager: entering starts every worker and ps task and waits
    until each serves; leaving stops them. Ports are free ports of `host`,
    picked when the object is made. Each server writes its stdout and stderr
    to files in `log_dir`; a temporary `log_dir` is removed on a clean exit
    and kept when a task failed or the `with` block raised.

    Args:
        workers: worker tasks to start (at least 1).
        ps: parameter-server tasks to start (at least 1).
        chief: whether the cluster has a `chief` task, this process or another
            one that trains; it is given an address but not started.
        cpus_per_worker: logical CPU devices each worker task makes of its CPU
            before serving, so that one worker task holds as many replicas.
        host: the address every task listens on.
        start_timeout: seconds to wait for the servers to serve, at start and
            at each `restart`.
        stop_timeout: seconds a server has to exit after SIGTERM before it is
            killed.
        log_dir: where to write the servers' output; by default a new
            temporary directory.
        env: extra environment variables for every server process.
        listen_ports: per `(task_type, index)`, a port that task listens on
            instead of its address's, which something else (a
            `PartitionProxy`) then serves, relaying to it.
        elastic: the chief may let workers join and leave
            (`strategy_for_cluster(max_workers=...,
            membership_port=local.membership_port)`): a free port is kept
            for its membership endpoint, every worker is started with
            `--join` (so SIGTERM makes it leave, see `leave`), and
            `join_worker` starts more.

    Raises:
        ValueError: a count below 1 or a `cpus_per_worker` below 1.

    Examples:
        Not run with the docstrings' tests: connecting makes the process the
        cluster's chief for good, so `tests/test_cluster.py` runs this in a
        chief process of its own.

        >>> from tf_diffmap import cluster
        >>> with cluster.LocalCluster(workers=2, ps=1) as local:  # doctest: +SKIP
        ...     strategy = cluster.strategy_for_cluster(local.resolver())
        ...     print(strategy.replica_devices)
    """

    def __init__(
        self,
        workers: int = 2,
        ps: int = 1,
        chief: bool = True,
        *,
        cpus_per_worker: int = 1,
        host: str = "127.0.0.1",
        start_timeout: float = 120.0,
        stop_timeout: float = 10.0,
        log_dir: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        listen_ports: Mapping[tuple[str, int], int] | None = None,
        elastic: bool = False,
    ) -> None:
        for name, value in (("workers", workers), ("ps", ps), ("cpus_per_worker", cpus_per_worker)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"LocalCluster needs {name} >= 1, received {value!r}; for example "
                    "LocalCluster(workers=2, ps=1)."
                )
        self._cpus_per_worker = cpus_per_worker
        self._start_timeout = float(start_timeout)
        self._stop_timeout = float(stop_timeout)
        self._env = dict(env or {})
        self._listen_ports = dict(listen_ports or {})
        self._given_log_dir = Path(log_dir) if log_dir is not None else None
        self._log_dir: Path | None = None
        self._state = "new"  # new -> started -> stopped
        self._failed = False
        # The process the servers are forked from (None: not started, or
        # no `os.fork` here, and each server is a process of its own).
        self._launcher: Launcher | None = None

        counts = {"worker": workers, "ps": ps, "chief": 1 if chief else 0}
        ports = iter(free_ports(sum(counts.values()) + 1, host))
        self._host = host
        self.elastic = elastic
        # The chief's membership endpoint, when it is elastic.
        self.membership_port = next(ports)
        # Workers started by `join_worker`, by the index the chief gave them.
        self._joined: dict[int, _Task] = {}
        self._spec = {
            job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in counts.items() if n
        }
        self._tasks = {
            (job, index): _Task(job, index, address)
            for job in SERVER_JOBS
            for index, address in enumerate(self._spec[job])
        }

    # -- what a chief needs ------------------------------------------------

    @property
    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster: job name to task addresses (`worker`, `ps`, `chief`)."""
        return {job: list(addresses) for job, addresses in self._spec.items()}

    def tf_config(self, task_type: str, index: int = 0) -> str:
        """The TF_CONFIG JSON string of one task, the chief included.

        Args:
            task_type: `"worker"`, `"ps"` or `"chief"`.
            index: the task's index in its job.

        Returns:
            `{"cluster": ..., "task": {"type": task_type, "index": index}}`.

        Raises:
            ValueError: no such task in this cluster.
        """
        self._check_task(task_type, index)
        return json.dumps({"cluster": self._spec, "task": {"type": task_type, "index": index}})

    def resolver(self) -> tf.distribute.cluster_resolver.SimpleClusterResolver:
        """A cluster resolver for the chief task, for `strategy_for_cluster`.

        Raises:
            ValueError: the cluster was made with `chief=False`.
        """
        self._check_task("chief", 0)
        return chief_resolver(self._spec)

    # -- the processes -----------------------------------------------------

    def exits(self) -> dict[tuple[str, int], str]:
        """Per started task whose process has exited, a line that says how.

        Returns:
            By `(task_type, index)`, how the task's process exited and where
            its stderr is.
        """
        return {
            key: (
                f"{task.name} (pid {task.process.pid}) exited with code "
                f"{task.process.returncode}; its stderr is {task.stderr_path}"
            )
            for key, task in self._tasks.items()
            if task.process is not None and not task.running()
        }

    @property
    def pids(self) -> dict[tuple[str, int], int]:
        """The pid of each started task's latest process, by `(task_type, index)`."""
        pids = {key: t.process.pid for key, t in self._tasks.items() if t.process is not None}
        pids.update({("worker", i): t.process.pid for i, t in self._joined.items()})
        return pids

    @property
    def launcher_pid(self) -> int | None:
        """The pid of the process the servers are forked from (None before
        the first server starts, after `stop`, or where each server is a
        process of its own)."""
        return None if self._launcher is None else self._launcher.pid

    @property
    def log_dir(self) -> Path | None:
        """The directory of the servers' output files (`None` before `start`)."""
        return self._log_dir

    def log_files(self, task_type: str, index: int) -> tuple[Path | None, Path | None]:
        """The stdout and stderr files of a task's latest process."""
        task = self._server_task(task_type, index)
        return task.stdout_path, task.stderr_path

    def is_running(self, task_type: str, index: int) -> bool:
        """Whether the task's latest process is alive."""
        return self._server_task(task_type, index).running()

    def start(self) -> LocalCluster:
        """Starts every worker and ps task and waits until each serves.

        Returns:
            This cluster.

        Raises:
            RuntimeError: the cluster was started before, or a task exited
                before serving (the message holds the end of its stderr).
            TimeoutError: a task did not serve within `start_timeout` seconds.
        """
        if self._state != "new":
            raise RuntimeError(
                f"This LocalCluster is already {self._state}; it starts once. "
                "Make a new LocalCluster for another run."
            )
        self._state = "started"
        if self._given_log_dir is not None:
            self._given_log_dir.mkdir(parents=True, exist_ok=True)
            self._log_dir = self._given_log_dir
        else:
            self._log_dir = Path(tempfile.mkdtemp(prefix="tf_diffmap_cluster_"))
        try:
            for task in self._tasks.values():
                self._launch(task)
            self._wait_serving(list(self._tasks.values()))
        except BaseException:
            self._failed = True
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops the processes this cluster started: SIGTERM, then SIGKILL.

        Safe to call more than once. Only the cluster's own processes, by the
        handles it started them with, are signalled.
        """
        if self._state != "started":
            return
        self._state = "stopped"
        live = []
        for task in self._tasks.values():
            if task.running():
                live.append(task.process)
            elif task.process is not None and not task.killed:
                self._failed = True  # it exited on its own
        for task in self._joined.values():
            if task.running():
                live.append(task.process)
        for process in live:
            if process.stdin is not None and self.elastic:
                # Ended at once, not asked to leave (SIGTERM would make an
                # elastic worker ask a chief that may be gone).
                process.stdin.close()
            else:
                process.terminate()
        deadline = time.monotonic() + self._stop_timeout
        for process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for task in [*self._tasks.values(), *self._joined.values()]:
            if task.process is not None and task.process.stdin is not None:
                task.process.stdin.close()
        if self._launcher is not None:
            self._launcher.stop()
            self._launcher = None
        if self._given_log_dir is None and not self._failed and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def kill(self, task_type: str, index: int) -> None:
        """Kills one worker or ps task (SIGKILL), as a crash would.

        Raises:
            ValueError: no such server task, or it is not running.
        """
        task = self._server_task(task_type, index)
        if not task.running():
            raise ValueError(
                f"{task.name} is not running; restart({task_type!r}, {index}) starts it again."
            )
        task.killed = True
        task.process.kill()
        task.process.wait()

    def restart(self, task_type: str, index: int) -> int:
        """Starts a task again at its address and port; stops it first if running.

        Returns:
            The pid of the new process.

        Raises:
            ValueError: no such server task.
            RuntimeError: the cluster is not started, or the task exited
                before serving.
            TimeoutError: the task did not serve within `start_timeout`.
        """
        task = self._server_task(task_type, index)
        if self._state != "started":
            raise RuntimeError(f"restart needs a started LocalCluster; this one is {self._state}.")
        if task.process is not None and not task.running() and not task.killed:
            self._failed = True  # it exited on its own: keep its log
        if task.running():
            task.process.terminate()
            try:
                task.process.wait(timeout=self._stop_timeout)
            except subprocess.TimeoutExpired:
                task.process.kill()
                task.process.wait()
        if task.process is not None and task.process.stdin is not None:
            task.process.stdin.close()
        task.killed = False
        self._launch(task)
        self._wait_serving([task])
        return task.process.pid

    @property
    def membership_address(self) -> str:
        """Where an elastic chief serves its membership endpoint."""
        return f"{self._host}:{self.membership_port}"

    def join_worker(self) -> tuple[int, int]:
        """Starts one more worker, which asks the chief for a slot, joins
        the cluster, and serves (`python -m tf_diffmap.cluster --join`).

        Returns:
            The worker's index, given by the chief, and its pid, once it
            serves.

        Raises:
            RuntimeError: the cluster is not started or not elastic, or the
                worker exited before serving (the chief refused it).
            TimeoutError: it did not serve within `start_timeout`.
        """
        if self._state != "started" or not self.elastic:
            raise RuntimeError(
                "join_worker needs a started LocalCluster(elastic=True), and a chief made "
                "with strategy_for_cluster(max_workers=..., membership_port="
                "local.membership_port)."
            )
        (port,) = free_ports(1, self._host)
        task = _Task("worker", -1 - len(self._joined), f"{self._host}:{port}", joined=True)
        self._launch(task)
        self._wait_serving([task])
        index = self._served_index(task)
        task.index = index
        self._joined[index] = task
        return index, task.process.pid

    def leave(self, index: int, timeout: float = 60.0) -> float:
        """Asks worker `index` to leave as a scale-down or a preemption
        notice does: SIGTERM, after which it asks the chief to let it go
        and exits once its replicas are out. Waits for it to exit.

        Returns:
            The seconds from the signal to its exit.

        Raises:
            ValueError: no such worker running.
            TimeoutError: it did not exit within `timeout` (it is then killed).
        """
        task = self._joined.get(index) or self._tasks.get(("worker", index))
        if task is None or not task.running():
            raise ValueError(f"worker {index} is not running.")
        task.killed = True  # stopped on purpose
        started = time.monotonic()
        task.process.send_signal(signal.SIGTERM)
        try:
            task.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            task.process.kill()
            task.process.wait()
            raise TimeoutError(
                f"worker {index} did not exit within {timeout:g} s of SIGTERM."
            ) from None
        return time.monotonic() - started

    def _served_index(self, task: _Task) -> int:
        for line in task.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"serving"' in line:
                return int(json.loads(line)["index"])
        raise RuntimeError(f"{task.name} printed no index")

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is not None:
            self._failed = True
        self.stop()

    def __repr__(self) -> str:
        jobs = ", ".join(f"{job}={len(addresses)}" for job, addresses in self._spec.items())
        return f"LocalCluster({jobs}, {self._state})"

    # -- internals ---------------------------------------------------------

    def _check_task(self, task_type: str, index: int) -> None:
        if task_type not in self._spec or not 0 <= index < len(self._spec[task_type]):
            tasks = ", ".join(f"{job} 0..{len(a) - 1}" for job, a in self._spec.items())
            hint = " (made with chief=False)" if task_type == "chief" else ""
            raise ValueError(
                f"This cluster has no task {task_type!r} {index!r}{hint}; its tasks are {tasks}."
            )

    def _server_task(self, task_type: str, index: int) -> _Task:
        if task_type == "worker" and index in self._joined:
            return self._joined[index]
        self._check_task(task_type, index)
        if task_type not in SERVER_JOBS:
            raise ValueError(
                f"LocalCluster starts only worker and ps tasks, not {task_type!r}: the chief "
                "is the process that uses resolver() or tf_config('chief')."
            )
        return self._tasks[(task_type, index)]

    def _launch(self, task: _Task) -> None:
        task.launches += 1
        name = (
            f"joined-{task.address.rpartition(':')[2]}"
            if task.joined
            else f"{task.job}-{task.index}"
        )
        stem = name + (f".{task.launches}" if task.launches > 1 else "")
        task.stdout_path = self._log_dir / f"{stem}.out"
        task.stderr_path = self._log_dir / f"{stem}.err"
        command = ["--exit-when-stdin-closes"]
        if task.job == "worker" and self._cpus_per_worker > 1:
            command += ["--logical-cpus", str(self._cpus_per_worker)]
        if task.job == "worker" and self.elastic:
            command += ["--join", self.membership_address]
        if (task.job, task.index) in self._listen_ports:
            command += ["--port", str(self._listen_ports[(task.job, task.index)])]
        # The servers import the same tf_diffmap as this process.
        package_root = str(Path(__file__).resolve().parents[2])
        python_path = os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "PYTHONPATH": python_path,
            **self._env,
        }
        if not task.joined:
            env["TF_CONFIG"] = self.tf_config(task.job, task.index)
        else:  # a worker that asks the chief for its slot (at its address again, if restarted)
            env.pop("TF_CONFIG", None)
            command += ["--address", task.address]
        if hasattr(os, "fork"):
            try:
                task.process = self._running_launcher(env).start(
                    command, env, task.stdout_path, task.stderr_path, self._start_timeout
                )
            except TimeoutError:
                raise TimeoutError(
                    f"{task.name} did not start serving within {self._start_timeout:g} s "
                    "(the launcher it is forked from was still loading TensorFlow); raise "
                    f"start_timeout on a busy machine. The launcher's stderr "
                    f"({self._log_dir / 'launcher.err'}):\n{_tail(self._log_dir / 'launcher.err')}"
                ) from None
            return
        with open(task.stdout_path, "wb") as out, open(task.stderr_path, "wb") as err:
            task.process = subprocess.Popen(
                [sys.executable, "-m", "tf_diffmap.cluster", *command],
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )

    def _running_launcher(self, env: Mapping[str, str]) -> Launcher:
        """The launcher the servers are forked from, started at the first
        launch (and again if it exited), with the servers' environment but
        a task's own (`TF_CONFIG`)."""
        if self._launcher is None or self._launcher.process.poll() is not None:
            if self._launcher is not None:
                self._launcher.stop()
            common = {k: v for k, v in env.items() if k != "TF_CONFIG"}
            self._launcher = Launcher(common, self._log_dir / "launcher.err")
        return self._launcher

    def _serving(self, task: _Task) -> bool:
        if task.stdout_path is None or not task.stdout_path.exists():
            return False
        for line in task.stdout_path.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"serving"' in line:
                return True
        return False

    def _wait_serving(self, tasks: list[_Task]) -> None:
        deadline = time.monotonic() + self._start_timeout
        pending = list(tasks)
        while pending:
            for task in list(pending):
                if self._serving(task):
                    pending.remove(task)
                    continue
                code = task.process.poll()
                if code is not None and not self._serving(task):
                    raise RuntimeError(
                        f"{task.name} (pid {task.process.pid}, {task.address}) exited with "
                        f"code {code} before serving. The end of its stderr "
                        f"({task.stderr_path}):\n{_tail(task.stderr_path)}"
                    )
            if pending and time.monotonic() > deadline:
                task = pending[0]
                names = ", ".join(t.name for t in pending)
                raise TimeoutError(
                    f"{names} did not start serving within {self._start_timeout:g} s; raise "
                    f"start_timeout on a busy machine. The end of {task.name}'s stderr "
                    f"({task.stderr_path}):\n{_tail(task.stderr_path)}"
                )
            if pending:
                time.sleep(0.1)
