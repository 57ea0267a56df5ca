"""The launcher: servers forked from a process that imported TensorFlow once.

Each forked server must behave as `python -m tf_diffmap.cluster` started by
`subprocess.Popen` did: its arguments, environment, session, output files
and standard input its own; its exit status (a signal's negative) reported;
and the launcher gone once stopped. Slow: it starts processes.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tf_diffmap.cluster.launcher import Launcher
from tf_diffmap.cluster.local import free_ports

pytestmark = pytest.mark.slow


def _config(port: int) -> str:
    return json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{port}"]}, "task": {"type": "worker", "index": 0}}
    )


def _serving(path, timeout=120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if '"serving"' in text:
            return text
        time.sleep(0.05)
    raise AssertionError(f"no serving line in {path}: {text!r}")


def test_forked_servers_are_processes_of_their_own_with_their_exit_reported(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    launcher = Launcher(env, tmp_path / "launcher.err")
    try:
        # A wrong argument: the command line's own error and status (2).
        wrong = launcher.start(
            ["--logical-cpus", "0"], env, tmp_path / "w.out", tmp_path / "w.err", 60
        )
        assert wrong.wait(timeout=60) == 2
        assert "--logical-cpus needs N >= 1" in (tmp_path / "w.err").read_text()

        first, second = free_ports(2)
        servers = []
        for name, port in (("a", first), ("b", second)):
            task_env = {**env, "TF_CONFIG": _config(port)}
            servers.append(
                launcher.start(
                    ["--exit-when-stdin-closes"],
                    task_env,
                    tmp_path / f"{name}.out",
                    tmp_path / f"{name}.err",
                    60,
                )
            )
        a, b = servers
        for name, port, server in zip("ab", (first, second), servers):
            text = _serving(tmp_path / f"{name}.out")
            # Each serves its own TF_CONFIG's task (its environment's).
            line = json.loads(text.splitlines()[-1])
            assert line["serving"] == "worker" and line["target"].endswith(f":{port}")
            assert server.poll() is None and os.getsid(server.pid) == server.pid
        assert a.pid != b.pid != launcher.pid
        # A signal's status is its negative, as Popen.returncode.
        a.kill()
        assert a.wait(timeout=60) == -signal.SIGKILL and a.poll() == -signal.SIGKILL
        a.kill()  # an exited server is not signalled again
        # The end of its standard input ends the other, cleanly.
        with pytest.raises(subprocess.TimeoutExpired):
            b.wait(timeout=0.2)
        b.stdin.close()
        assert b.wait(timeout=60) == 0
        assert "Standard input closed" in (tmp_path / "b.err").read_text()
    finally:
        launcher.stop()
    assert launcher.process.poll() is not None
    with pytest.raises(RuntimeError, match="launcher"):
        launcher.start(["--help"], env, tmp_path / "h.out", tmp_path / "h.err", 5)


def test_a_server_whose_launcher_was_killed_is_still_stopped_and_waited_for(tmp_path):
    """Killed, the launcher reports no exit: a server it forked counts as
    exited once its pid is gone, so that stopping it never waits for ever."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    launcher = Launcher(env, tmp_path / "launcher.err")
    try:
        (port,) = free_ports(1)
        server = launcher.start(
            ["--exit-when-stdin-closes"],
            {**env, "TF_CONFIG": _config(port)},
            tmp_path / "s.out",
            tmp_path / "s.err",
            60,
        )
        _serving(tmp_path / "s.out")
        launcher.process.kill()
        launcher.process.wait()
        with pytest.raises(subprocess.TimeoutExpired):
            server.wait(timeout=0.3)  # still serving, orphaned
        assert server.poll() is None
        server.kill()
        assert server.wait(timeout=60) == server.UNKNOWN_EXIT
    finally:
        launcher.stop()


WAITS_FOR_A_SIGNAL = """
import os, sys, tempfile, time
print(sys.argv[1:], os.environ["WHO"], tempfile.gettempdir(), flush=True)
try:
    time.sleep(60)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


def test_another_module_is_forked_as_a_new_interpreter_would_run_it(tmp_path):
    # The test suite's chiefs run so: `python -m run_script PATH ARGS`.
    script = tmp_path / "waits.py"
    script.write_text(WAITS_FOR_A_SIGNAL)
    # This folder importable, for `run_script`.
    tests = os.pathsep.join(
        p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p
    )
    launcher = Launcher({**os.environ, "PYTHONPATH": tests}, tmp_path / "launcher.err")
    try:
        env = {**os.environ, "PYTHONPATH": tests, "WHO": "the request's", "TMPDIR": str(tmp_path)}
        out = tmp_path / "waits.out"
        process = launcher.start(
            [str(script), "a", "b"], env, out, tmp_path / "waits.err", 120, module="run_script"
        )
        deadline = time.monotonic() + 120
        while "the request's" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline, (tmp_path / "waits.err").read_text()
            time.sleep(0.05)
        # Its arguments, its environment, its own temporary folder.
        assert out.read_text().splitlines()[0] == f"['a', 'b'] the request's {tmp_path}"
        # Ctrl-C's signal raises KeyboardInterrupt, as in a new interpreter.
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 3
        assert out.read_text().splitlines()[1] == "interrupted"
    finally:
        launcher.stop()


# A chief that starts its cluster before it builds anything: TensorFlow
# imported, its runtime not started. `probe` is forked by the launcher.
FORKS_ITS_LAUNCHER = """
import json, os, select, sys
from pathlib import Path
import tensorflow as tf
from tf_diffmap.cluster.launcher import Launcher, _ForkedLauncher

out = Path(sys.argv[1])
sys.path.insert(0, str(out))
(out / "probe.py").write_text(
    "import json, os, sys\\n"
    "print(json.dumps({'tf_loaded': 'tensorflow' in sys.modules, 'sid': os.getsid(0),"
    " 'pid': os.getpid(), 'who': os.environ.get('WHO'), 'stdin': sys.stdin.read()}))\\n"
)
# A pipe whose write end this process holds: the launcher must not keep it.
read_end, write_end = os.pipe()
launcher = Launcher(dict(os.environ, WHO="the launcher's"), out / "launcher.err")
os.close(write_end)
ended = bool(select.select([read_end], [], [], 30)[0]) and os.read(read_end, 1) == b""
probe = launcher.start([], dict(os.environ, WHO="the probe's"), out / "p.out", out / "p.err", 60,
                       module="probe")
probe.stdin.close()
code = probe.wait(timeout=60)
report = {
    "forked": isinstance(launcher.process, _ForkedLauncher),
    "launcher_sid": os.getsid(launcher.pid) == launcher.pid,
    "pipe_ended": ended,
    "probe_exit": code,
    "probe": json.loads((out / "p.out").read_text()),
}
launcher.stop()
report["launcher_exit"] = launcher.process.returncode
tf.constant(1.0)  # the runtime starts: a launcher is a new interpreter again
second = Launcher(dict(os.environ), out / "second.err")
report["second_forked"] = isinstance(second.process, _ForkedLauncher)
second.stop()
print(json.dumps(report))
"""


def test_a_process_that_has_not_started_tensorflow_forks_its_launcher(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = subprocess.run(
        [sys.executable, "-c", FORKS_ITS_LAUNCHER, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    probe = report.pop("probe")
    assert report == {
        "forked": True,
        "launcher_sid": True,
        "pipe_ended": True,
        "probe_exit": 0,
        "launcher_exit": 0,
        "second_forked": False,
    }, (tmp_path / "launcher.err").read_text()
    # Forked from the launcher, with TensorFlow loaded: a process and a
    # session of its own, its own environment and standard input.
    assert probe["tf_loaded"] and probe["sid"] == probe["pid"]
    assert probe["who"] == "the probe's" and probe["stdin"] == ""
