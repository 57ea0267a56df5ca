"""The cluster tests' own helpers (`cluster_chief`): a task a chief paused
is resumed and stopped even when the chief is killed first."""

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cluster_chief import pause_task, resume_paused_tasks, run_chief_script


def _state(pid: int) -> str | None:
    """The process's state letter (T: stopped, Z: ended, unreaped), or None."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


def _reaches(pid: int, states, seconds: float = 10.0) -> bool:
    """Whether the process is in one of `states` within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if _state(pid) in states:
            return True
        time.sleep(0.05)
    return False


def _ended(pid: int) -> bool:
    return _reaches(pid, (None, "Z", "X"))


def test_a_paused_task_is_resumed_and_stopped_and_another_process_is_left_alone(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        pause_task(task.pid)
        assert _reaches(task.pid, ("T",)), _state(task.pid)
        # A line for a pid whose process started at another time: a pid used
        # again by another process, which is not signalled.
        with open(tmp_path / "paused_tasks", "a") as noted:
            noted.write(f"{other.pid} 1\n")
        assert resume_paused_tasks(tmp_path) == [task.pid]
        assert task.wait(10) == -15  # resumed, then ended by SIGTERM
        assert other.poll() is None
    finally:
        for process in (task, other):
            process.kill()
            process.wait()


CHIEF_THAT_HANGS = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from cluster_chief import pause_task

    task = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    pause_task(task.pid)
    with open(os.path.join(os.environ["TMPDIR"], "task_pid"), "w") as out:
        out.write(str(task.pid))
    time.sleep(120)  # past the test's timeout: killed before it resumes its task
    """
)


def test_a_chief_killed_at_its_timeout_leaves_no_task_paused(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_chief_script(CHIEF_THAT_HANGS, tmp_path, timeout=5.0)
    pid = int((tmp_path / "task_pid").read_text())
    assert _ended(pid), _state(pid)
