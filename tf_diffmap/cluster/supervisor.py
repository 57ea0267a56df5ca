"""A supervisor for a cluster on one machine: tasks that exit start again.

`Supervisor` watches the worker and ps processes of a started
`LocalCluster`: one that exits without being stopped is started again at
its address, up to `max_restarts` times per task, and each restart is
reported with the time the task took to serve again. Given a command (the
training script), it also runs that as the chief, with the chief's
TF_CONFIG, and runs it again when it fails, up to `max_restarts` times, in
the manner of torchrun's elastic agent: a script that passes
`keras.callbacks.BackupAndRestore` to `fit` resumes at the epoch it had
reached. That is how a lost ps is survived without a human: its variables
are gone with it, the chief's `fit` raises an error naming it, the ps
serves again, fresh, and the chief's next run restores the last backup.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tf_diffmap.cluster.local import SERVER_JOBS, LocalCluster

__all__ = ["Supervisor"]


class Supervisor:
    """Restarts the tasks of a started `LocalCluster` that exit, and its chief.

    Args:
        local: a started cluster.
        max_restarts: how often each task, and the chief, may be started
            again.
        command: the chief's command line, or None (the chief runs
            elsewhere).
        say: where reports go (a line each), by default standard error.
    """

    def __init__(
        self,
        local: LocalCluster,
        max_restarts: int,
        command: Sequence[str] | None = None,
        say: Callable[[str], None] | None = None,
    ):
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, received {max_restarts!r}.")
        self.local = local
        self.max_restarts = max_restarts
        self.command = list(command) if command else None
        self._say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.restarts: dict[tuple[str, int], int] = {}
        self._reported: set[tuple[str, int]] = set()
        self.chief: subprocess.Popen | None = None
        self.chief_runs = 0
        self._chief_ended: float | None = None

    def start_chief(self) -> None:
        """Starts the chief's command with the chief's TF_CONFIG."""
        env = dict(os.environ, TF_CONFIG=self.local.tf_config("chief", 0))
        self.chief_runs += 1
        self.chief = subprocess.Popen(self.command, env=env)
        if self._chief_ended is not None:
            self._say(
                f"chief: run {self.chief_runs} started (pid {self.chief.pid}), "
                f"{time.monotonic() - self._chief_ended:.1f} s after the last one failed"
            )
        else:
            self._say(f"chief: started (pid {self.chief.pid}): {' '.join(self.command)}")

    def poll(self) -> int | None:
        """One look: restarts what exited. Returns the chief's exit status
        once it is final (0, or a failure past `max_restarts`), else None."""
        for key in self.local.exits():
            job, index = key
            if job not in SERVER_JOBS or self.local.is_running(job, index):
                continue
            done = self.restarts.get(key, 0)
            if done >= self.max_restarts:
                if key not in self._reported:
                    self._reported.add(key)
                    self._say(
                        f"{job} {index} exited and was restarted {done} time(s) already "
                        f"(--max-restarts {self.max_restarts}); it stays down."
                    )
                continue
            self.restarts[key] = done + 1
            started = time.monotonic()
            self._say(
                f"{job} {index} exited; starting it again at "
                f"{self.local.cluster_spec[job][index]} (restart {done + 1} of "
                f"{self.max_restarts})"
            )
            try:
                pid = self.local.restart(job, index)
            except (RuntimeError, TimeoutError) as error:
                self._say(f"{job} {index} did not start again: {error}")
                continue
            self._say(
                f"{job} {index} serves again (pid {pid}) after {time.monotonic() - started:.1f} s"
            )
        if self.chief is None or self.chief.poll() is None:
            return None
        code = self.chief.returncode
        if code == 0:
            self._say(f"chief: finished after {self.chief_runs} run(s)")
            return 0
        if self.chief_runs > self.max_restarts:
            self._say(
                f"chief: exited with code {code}, run {self.chief_runs}; no restart left "
                f"(--max-restarts {self.max_restarts})"
            )
            return code
        self._chief_ended = time.monotonic()
        self._say(f"chief: exited with code {code}; running it again")
        self.start_chief()
        return None

    def stop_chief(self) -> None:
        """Stops the chief this supervisor started (SIGTERM, then SIGKILL)."""
        if self.chief is not None and self.chief.poll() is None:
            self.chief.terminate()
            try:
                self.chief.wait(10)
            except subprocess.TimeoutExpired:
                self.chief.kill()
                self.chief.wait()
