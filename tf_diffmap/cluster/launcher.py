"""Server processes forked from one that imported TensorFlow once.

Importing TensorFlow costs a new process about 4.5 s of CPU (its native
library loads and links): more than starting and connecting a server. A
`LocalCluster` of two workers and a ps spent most of its start there, on
every core at once, and each restart of a killed task paid it again. So a
`LocalCluster` starts one *launcher* process (`python -m
tf_diffmap.cluster.launcher`), which imports TensorFlow and the command
line's modules once, before any TensorFlow runtime, thread pool or
connection exists, and then forks each server: a fork starts with
TensorFlow loaded.

A server started so is still a process of its own, as `python -m
tf_diffmap.cluster ARGS` would be: a session of its own (a Ctrl-C meant for
the chief does not reach it), its environment, its output in its log files,
and a standard input (a pipe whose write end the starting process holds)
that ends when that process closes it or dies. `ServerProcess` gives the
part of `subprocess.Popen`'s interface that `LocalCluster` uses: the pid,
`poll`, `wait`, the signals, and `stdin.close()`. The launcher reports each
server's exit; it ends when the process that started it closes its socket
(`Launcher.stop`) or dies. Where `os.fork` does not exist, servers are
started by `subprocess.Popen` instead. `Launcher.start` forks another
module's command line the same way (`python -m MODULE ARGS`); the test
suite runs its chief scripts so.

A process that has imported TensorFlow but not started its runtime (a
chief that starts its `LocalCluster` before it builds anything) forks the
launcher itself rather than starting a new interpreter: the launcher then
starts with TensorFlow loaded too. It is forked only while the process
runs one Python thread, and where TensorFlow's variables (`TF_*`, which
TensorFlow reads as it loads) are the launcher's; the fork takes a
session of its own and lets go of every descriptor it inherited, as a new
process would start.

The launcher and the process that started it speak over a Unix socket of
datagrams in sequence (`SOCK_SEQPACKET`): a request is one JSON message
with the server's standard input passed beside it (`socket.send_fds`); an
answer is `{"id", "pid"}` (started) or `{"pid", "exit"}` (its exit status,
negative for a signal, as `Popen.returncode`).
"""

from __future__ import annotations

import itertools
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Launcher", "ServerProcess"]

_MESSAGE_BYTES = 1 << 20
# How often the launcher looks for servers that exited, between requests.
_REAP_SECONDS = 0.05


def _alive(pid: int) -> bool:
    """Whether a process runs (a zombie, which nobody has reaped yet, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return True  # no /proc here: the signal's answer stands


class ServerProcess:
    """A server the launcher forked, with the part of `subprocess.Popen`'s
    interface that `LocalCluster` uses.

    Its exit status is the launcher's report. Where the launcher itself is
    gone (killed), nothing reports it: the server counts as exited once its
    pid is gone, with status `UNKNOWN_EXIT`.
    """

    UNKNOWN_EXIT = 1

    def __init__(self, pid: int, stdin):
        self.pid = pid
        self.stdin = stdin
        self.returncode: int | None = None
        self._exited = threading.Event()
        self._orphaned = False

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def _orphan(self) -> None:
        """The launcher is gone: the pid alone tells whether it runs."""
        self._orphaned = True
        self._exited.set()  # `wait` looks at the pid from now on

    def poll(self) -> int | None:
        if self.returncode is None and self._orphaned and not _alive(self.pid):
            self.returncode = self.UNKNOWN_EXIT
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            self._exited.wait(left)
            if self.poll() is not None:
                return self.returncode
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"tf_diffmap server {self.pid}", timeout)
            time.sleep(_REAP_SECONDS)  # orphaned: its pid is looked at again

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """A launcher process, and the servers it forked for this process.

    Args:
        env: the launcher's environment (the servers' but for what each
            request adds): TensorFlow reads some of it as it loads.
        stderr: where the launcher writes its own errors.
    """

    def __init__(self, env: Mapping[str, str], stderr: Path):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        if _may_fork_here(env):
            self.process: subprocess.Popen | _ForkedLauncher = _ForkedLauncher.fork(
                theirs.fileno(), env, stderr
            )
        else:
            with open(stderr, "wb") as err:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "tf_diffmap.cluster.launcher", str(theirs.fileno())],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    env=dict(env),
                    pass_fds=[theirs.fileno()],
                    start_new_session=True,
                )
        theirs.close()
        self._socket = ours
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._started: dict[int, tuple[threading.Event, list]] = {}
        self._servers: dict[int, ServerProcess] = {}
        # Exits reported before the start's answer was read.
        self._early_exits: dict[int, int] = {}
        # Whether the launcher's socket ended (no exit is reported after).
        self._gone = False
        self._reader = threading.Thread(target=self._read, name="tf_diffmap-launcher", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def start(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        stdout: Path,
        stderr: Path,
        timeout: float,
        module: str = "tf_diffmap.cluster",
    ) -> ServerProcess:
        """Forks `python -m MODULE ARGV` (by default the server's command
        line) with environment `env`, its output in `stdout` and `stderr`.

        Raises:
            RuntimeError: the launcher exited.
            TimeoutError: it did not fork the server within `timeout`
                seconds (it imports TensorFlow first; a server forked
                later finds its standard input closed, and ends).
        """
        read_end, write_end = os.pipe()
        started = threading.Event()
        answer: list = []
        with self._lock:
            number = next(self._ids)
            self._started[number] = (started, answer)
        request = {
            "id": number,
            "module": module,
            "argv": list(argv),
            "env": dict(env),
            "stdout": str(stdout),
            "stderr": str(stderr),
        }
        try:
            socket.send_fds(self._socket, [json.dumps(request).encode()], [read_end])
        except OSError as error:
            os.close(write_end)
            raise RuntimeError(f"The server launcher (pid {self.pid}) is gone: {error}") from None
        finally:
            os.close(read_end)
        if not started.wait(timeout) or not answer:
            os.close(write_end)
            with self._lock:
                self._started.pop(number, None)  # a late answer is dropped
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"The server launcher (pid {self.pid}) exited with code "
                    f"{self.process.returncode} before it started a server."
                )
            raise TimeoutError(
                f"The server launcher (pid {self.pid}) did not start a server within {timeout:g} s."
            )
        server = ServerProcess(answer[0], open(write_end, "wb", buffering=0))  # noqa: SIM115
        with self._lock:
            self._servers[server.pid] = server
            early = self._early_exits.pop(server.pid, None)
            gone = self._gone
        if early is not None:
            server._exit(early)
        elif gone:
            server._orphan()
        return server

    def stop(self) -> None:
        """Ends the launcher (it forks no more); the servers it forked are
        the caller's to stop, and end with their standard input. A launcher
        that does not end within a second (it may still be importing
        TensorFlow, and would read a request sent before) is killed: it
        holds nothing of the servers'."""
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=30)

    def _read(self) -> None:
        """Hands each answer to the start that waits for it, and each exit to
        its server."""
        while True:
            try:
                message = self._socket.recv(_MESSAGE_BYTES)
            except OSError:
                message = b""
            if not message:
                break
            answer = json.loads(message)
            with self._lock:
                if "id" in answer:
                    waiting = self._started.pop(answer["id"], None)
                    if waiting is not None:
                        started, slot = waiting
                        slot.append(answer["pid"])
                        started.set()
                    continue
                server = self._servers.pop(answer["pid"], None)
                if server is None:
                    self._early_exits[answer["pid"]] = answer["exit"]
            if server is not None:
                server._exit(answer["exit"])
        # The launcher is gone: no start is answered now, and no exit.
        with self._lock:
            self._gone = True
            waiting, self._started = list(self._started.values()), {}
            orphans = list(self._servers.values())
        for started, _ in waiting:
            started.set()
        for server in orphans:
            server._orphan()


def _may_fork_here(env: Mapping[str, str]) -> bool:
    """Whether this process may fork the launcher rather than start one:
    it has imported TensorFlow and not started its runtime, runs one
    Python thread (a fork copies only the thread that forks, and a lock
    another one held would stay held), and TensorFlow loaded with the
    launcher's `TF_*` variables."""
    if not hasattr(os, "fork") or not os.path.isdir(_OPEN_FDS):
        return False
    if "tensorflow" not in sys.modules or threading.active_count() != 1:
        return False
    loaded = {k: v for k, v in os.environ.items() if k.startswith("TF_") and k != "TF_CONFIG"}
    wanted = {k: v for k, v in env.items() if k.startswith("TF_") and k != "TF_CONFIG"}
    if loaded != wanted:
        return False
    from tf_diffmap import _tf_internal

    return not _tf_internal.runtime_started()


# The descriptors a process holds, one entry each (Linux).
_OPEN_FDS = "/proc/self/fd"


class _ForkedLauncher:
    """A launcher forked from this process, with the part of
    `subprocess.Popen`'s interface that `Launcher` uses (it is this
    process' child: its exit status is its own to read)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def fork(cls, fd: int, env: Mapping[str, str], stderr: Path) -> _ForkedLauncher:
        """Forks a launcher that reads its requests on socket `fd`, with
        environment `env` and its errors written to `stderr`."""
        inherited = [int(name) for name in os.listdir(_OPEN_FDS)]
        with warnings.catch_warnings():
            # Python 3.12+ warns of a fork while TensorFlow's own threads
            # (made as it loads) run; the launcher process forks so too.
            warnings.filterwarnings(
                "ignore", "This process .* is multi-threaded", DeprecationWarning
            )
            pid = os.fork()
        if pid == 0:
            _run_forked_launcher(fd, inherited, env, stderr)
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                done, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = ServerProcess.UNKNOWN_EXIT
                return self.returncode
            if done:
                self.returncode = _exit_status(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"tf_diffmap launcher {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _run_forked_launcher(
    fd: int, inherited: Sequence[int], env: Mapping[str, str], stderr: Path | str
) -> None:
    """In a launcher forked from the process that uses it: what a new
    process would start with (a session of its own, standard input and
    output on the null device, its errors in `stderr`, its environment,
    the interpreter's signal handlers), then the launcher. Every other
    descriptor it inherited is pointed at the null device: what it held (a
    pipe that another process reads to its end, a listening socket) is let
    go, while its number stays taken, so that an object of the forking
    process that closes it later closes nothing of the launcher's. Never
    returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDWR)
        for number in inherited:
            if number > 2 and number not in (fd, null):
                try:
                    os.dup2(null, number)
                except OSError:
                    pass  # closed since it was listed
        _start_as_new_process(env, null, os.devnull, stderr)
        _launcher_main(fd)
        code = 0
    except BaseException:  # noqa: BLE001 - written where the launcher's errors go
        traceback.print_exc()
    finally:
        _end(code)


# -- in the launcher process ---------------------------------------------------


def _exit_status(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _serve_forked(request: dict, stdin: int) -> None:
    """In a forked server: its session, environment, output and input,
    then `python -m MODULE ARGV`. Never returns."""
    code = 1
    try:
        _start_as_new_process(request["env"], stdin, request["stdout"], request["stderr"])
        # What `python -m MODULE ARGV` runs (the server's command line ends
        # in `sys.exit` with its status).
        module = request["module"]
        sys.argv = [f"python -m {module}", *request["argv"]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as error:
        if error.code is None or isinstance(error.code, int):
            code = error.code or 0
        else:  # a message, printed as the interpreter would, with status 1
            print(error.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed, as the interpreter would
        traceback.print_exc()
    finally:
        _end(code)


def _start_as_new_process(
    env: Mapping[str, str], stdin: int, stdout: str | Path, stderr: str | Path
) -> None:
    """In a forked process: what a new interpreter started by
    `subprocess.Popen(..., start_new_session=True)` would have. A session
    of its own, environment `env` (and its TMPDIR, read again), standard
    input from descriptor `stdin` (closed here), output and errors to the
    files `stdout` and `stderr`, and the interpreter's signal handlers."""
    os.setsid()
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None
    for path, fd in ((stdout, 1), (stderr, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.dup2(stdin, 0)
    os.close(stdin)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)


def _end(code: int) -> None:
    """Ends a forked process with `code`, its output flushed first (no
    handler of the process it was forked from runs)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001, S110 - the process ends either way
            pass
    os._exit(code)


def _launcher_main(fd: int) -> None:
    """Forks a server per request on socket `fd`, and reports each start
    and exit, until the socket closes."""
    # What every server needs, loaded once (TensorFlow with them); the
    # command line itself reads its arguments before it imports these.
    import tf_diffmap.cluster.member  # noqa: F401
    import tf_diffmap.cluster.server  # noqa: F401

    channel = socket.socket(fileno=fd)
    children: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(channel, selectors.EVENT_READ)

    def reap() -> None:
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                channel.send(json.dumps({"pid": pid, "exit": _exit_status(status)}).encode())

    try:
        while True:
            if selector.select(_REAP_SECONDS):
                message, fds, _, _ = socket.recv_fds(channel, _MESSAGE_BYTES, 1)
                if not message:
                    return  # the process that started the launcher is done with it
                request = json.loads(message)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    channel.close()
                    _serve_forked(request, fds[0])
                os.close(fds[0])
                children.add(pid)
                channel.send(json.dumps({"id": request["id"], "pid": pid}).encode())
            reap()
    except (BrokenPipeError, ConnectionResetError):
        return  # the process that started the launcher is gone


if __name__ == "__main__":
    _launcher_main(int(sys.argv[1]))
