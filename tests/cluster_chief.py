"""What the multi-process cluster tests share: the chief's toy task, and how
a test runs a chief.

A chief is a script run in a process of its own (connecting makes a process
the cluster's chief for good). `chief_env` gives it this folder on its
path, so that it can `from cluster_chief import toy_task`; `run_chief_script`
runs one and returns the JSON report its last line prints. Chiefs are forked
from a launcher that imported TensorFlow once: a chief's import of it
(about 5 s of CPU) was the largest part of many cluster tests' cost.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tf_diffmap.cluster.launcher import Launcher

HERE = Path(__file__).resolve().parent

# Where a chief notes each task it pauses, under its TMPDIR (`pause_task`).
PAUSED_TASKS = "paused_tasks"


def chief_env(tmp_path: Path, log_level: str = "3", **more: str) -> dict[str, str]:
    """The environment of a chief (or of the command that runs one): its
    temporary files (the cluster's logs among them) under `tmp_path`,
    TensorFlow's C++ logging at `log_level`, and this folder importable."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    return dict(
        os.environ, TMPDIR=str(tmp_path), TF_CPP_MIN_LOG_LEVEL=log_level, PYTHONPATH=path, **more
    )


def run_chief_script(
    source: str,
    tmp_path: Path,
    *args: str,
    timeout: float,
    log_level: str = "3",
    with_stderr: bool = False,
) -> dict:
    """Runs `source` with `args` as a chief; returns the JSON of its last
    line of output (with its standard error as `"stderr"` if asked).

    The chief is a process of its own, forked from a launcher that imported
    TensorFlow once for this test process (`tf_diffmap.cluster.launcher`),
    as `python -c SOURCE ARGS` would run it otherwise; `timeout` counts
    from the fork. Raises `subprocess.TimeoutExpired` for a chief killed at
    its timeout.
    """
    number = next(_CHIEFS)
    script = tmp_path / f"chief_{number}.py"
    script.write_text(source)
    out, err = tmp_path / f"chief_{number}.out", tmp_path / f"chief_{number}.err"
    env = chief_env(tmp_path, log_level)
    try:
        if hasattr(os, "fork"):
            chief = _launcher(log_level).start(
                [str(script), *args], env, out, err, timeout=_LAUNCHER_SECONDS, module="run_script"
            )
            chief.stdin.close()
            try:
                returncode = chief.wait(timeout)
            except subprocess.TimeoutExpired:
                chief.kill()
                chief.wait()
                raise
        else:
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                returncode = subprocess.run(
                    [sys.executable, "-c", source, *args],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    timeout=timeout,
                ).returncode
    finally:
        # A chief that timed out was killed before it could resume a task it
        # paused: stopped, that task would never read the end of its input.
        resume_paused_tasks(tmp_path)
    stdout, stderr = out.read_text(), err.read_text()
    assert returncode == 0, stderr[-4000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    if with_stderr:
        report["stderr"] = stderr
    return report


_CHIEFS = itertools.count()
# How long a launcher may take to fork a chief (it imports TensorFlow first).
_LAUNCHER_SECONDS = 300.0
_LAUNCHERS: dict[str, Launcher] = {}


def _launcher(log_level: str) -> Launcher:
    """This process' launcher of chiefs with TensorFlow's C++ logging at
    `log_level` (read as TensorFlow loads), started at its first use and
    stopped as the process exits."""
    launcher = _LAUNCHERS.get(log_level)
    if launcher is None or launcher.process.poll() is not None:
        home = Path(tempfile.mkdtemp(prefix="tf_diffmap_chiefs_"))
        launcher = Launcher(chief_env(home, log_level), home / "launcher.err")
        _LAUNCHERS[log_level] = launcher
        atexit.register(shutil.rmtree, home, ignore_errors=True)
        atexit.register(launcher.stop)
    return launcher


def toy_task(strategy, examples: int, learning_rate: float = 0.05, metrics=()):
    """The task the chiefs train: whether 8 normal features sum above 0, for
    a model of one hidden layer made in `strategy`'s scope.

    Returns:
        `(x, y, model)`, the data the same for the same `examples`.
    """
    import keras
    import numpy as np

    x = np.random.default_rng(0).normal(size=(examples, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.SGD(learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=list(metrics) or None,
        )
    return x, y, model


def record_fit_error(report: dict, error: Exception) -> None:
    """Puts what a chief's `fit` raised into its report: the error's type
    and message, the seconds since `report["killed_at"]` (the fault the
    chief caused, if any), and the runtime's own error, which the package
    keeps as `error.runtime_error` (`fit` clears `__cause__`)."""
    import time

    report["raised"] = type(error).__name__
    report["message"] = str(error)
    report["seconds"] = time.monotonic() - report.get("killed_at", time.monotonic())
    details = getattr(error, "runtime_error", None)
    report["runtime_error"] = [type(details).__name__, str(details)]


def pause_task(pid: int) -> None:
    """Pauses a task of the chief's cluster (SIGSTOP), from the chief, noting
    its pid and start time first under the chief's TMPDIR, so that the test
    resumes and stops it if the chief is killed first (`resume_paused_tasks`)."""
    with open(Path(os.environ["TMPDIR"]) / PAUSED_TASKS, "a") as noted:
        noted.write(f"{pid} {_start_time(pid)}\n")
    os.kill(pid, signal.SIGSTOP)


def resume_paused_tasks(tmp_path: Path) -> list[int]:
    """Resumes (SIGCONT) and ends (SIGTERM) each task a chief under
    `tmp_path` paused that still runs, found by its pid and start time (a pid
    used again by another process is left alone).

    Returns:
        The pids signalled.
    """
    noted = Path(tmp_path) / PAUSED_TASKS
    if not noted.exists():
        return []
    signalled = []
    for line in noted.read_text().splitlines():
        pid, started = (int(word) for word in line.split())
        if _start_time(pid) != started:
            continue  # gone (the chief resumed it and its cluster stopped it)
        for signum in (signal.SIGCONT, signal.SIGTERM):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                break
        signalled.append(pid)
    return signalled


def _start_time(pid: int) -> int:
    """The process's start time in clock ticks since boot (-1: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    # After the command's name, in parentheses: field 22 is the start time.
    return int(stat.rpartition(")")[2].split()[19])
