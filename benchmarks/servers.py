"""Plain `tf.distribute.Server`s on localhost, for `ParameterServerStrategy`.

tf-keras' ParameterServerStrategy runs in a Python of its own, whose server
processes need nothing but TensorFlow: `LocalServers` starts one
`python -m benchmarks.servers` process per worker and ps task, with the
habits of `tf_diffmap.cluster.LocalCluster` (its `free_ports` of
127.0.0.1, a session of its own, exit when standard input closes), and stops
exactly the processes it started, by their handles. Nothing here imports
TensorFlow until a server runs.

    TF_CONFIG='{"cluster": {...}, "task": {"type": "ps", "index": 0}}' \\
        python -m benchmarks.servers
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["LocalServers", "serve"]

ROOT = Path(__file__).resolve().parent.parent
READY = "serving"
# The port a server listens on where it is not its address's (`listen_ports`).
LISTEN_PORT = "BENCHMARK_SERVER_LISTEN_PORT"


class LocalServers:
    """Worker and ps servers as child processes; the chief is the caller.

    A context manager: entering starts every server and waits until each
    serves; leaving stops them (SIGTERM, then SIGKILL), by their handles.

    Args:
        workers: worker tasks.
        ps: parameter-server tasks.
        python: the interpreter of the servers (by default this one).
        host: the address every task listens on.
        start_timeout: seconds to wait for every server to serve.
        env: extra environment variables for every server.
        listen_ports: `{(job, index): port}`: tasks that listen on a port
            other than their address's, where a relay at their address
            (`tf_diffmap.cluster.PartitionProxy`) passes the others' traffic on.
    """

    def __init__(
        self,
        workers: int = 2,
        ps: int = 1,
        python: str | None = None,
        host: str = "127.0.0.1",
        start_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        listen_ports: dict[tuple[str, int], int] | None = None,
    ):
        # Imported here: the servers' own processes need no tf_diffmap.
        from tf_diffmap.cluster.local import free_ports

        ports = iter(free_ports(workers + ps + 1, host))
        self.cluster_spec = {
            "worker": [f"{host}:{next(ports)}" for _ in range(workers)],
            "ps": [f"{host}:{next(ports)}" for _ in range(ps)],
            "chief": [f"{host}:{next(ports)}"],
        }
        self._python = python or sys.executable
        self._start_timeout = start_timeout
        self._processes: list[tuple[str, subprocess.Popen, Path]] = []
        self._log_dir: Path | None = None
        self._env = dict(env or {})
        self._listen_ports = dict(listen_ports or {})

    @property
    def pids(self) -> list[int]:
        return [p.pid for _, p, _ in self._processes]

    @property
    def task_pids(self) -> dict[str, int]:
        """Each server's process id, by task name (`"worker 0"`, `"ps 0"`)."""
        return {name: p.pid for name, p, _ in self._processes}

    def resolver(self):
        """The chief's cluster resolver (imports TensorFlow)."""
        from tf_diffmap.cluster.local import chief_resolver

        return chief_resolver(self.cluster_spec)

    def start(self) -> LocalServers:
        self._log_dir = Path(tempfile.mkdtemp(prefix="benchmark_servers_"))
        env = {
            **os.environ,
            "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
            ),
            **self._env,
        }
        try:
            for job in ("worker", "ps"):
                for index in range(len(self.cluster_spec[job])):
                    config = {"cluster": self.cluster_spec, "task": {"type": job, "index": index}}
                    listen = self._listen_ports.get((job, index))
                    port_env = {} if listen is None else {LISTEN_PORT: str(listen)}
                    stem = self._log_dir / f"{job}-{index}"
                    with open(f"{stem}.out", "wb") as out, open(f"{stem}.err", "wb") as err:
                        process = subprocess.Popen(
                            [self._python, "-m", "benchmarks.servers"],
                            stdin=subprocess.PIPE,
                            stdout=out,
                            stderr=err,
                            env={**env, "TF_CONFIG": json.dumps(config), **port_env},
                            cwd=ROOT,
                            start_new_session=True,
                        )
                    self._processes.append((f"{job} {index}", process, stem))
            self._wait_serving()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_serving(self) -> None:
        deadline = time.monotonic() + self._start_timeout
        pending = list(self._processes)
        while pending:
            for entry in list(pending):
                name, process, stem = entry
                if READY in Path(f"{stem}.out").read_text(errors="replace"):
                    pending.remove(entry)
                elif process.poll() is not None:
                    raise RuntimeError(
                        f"{name} (pid {process.pid}) exited with code {process.returncode} "
                        f"before serving: {Path(f'{stem}.err').read_text(errors='replace')[-2000:]}"
                    )
            if pending and time.monotonic() > deadline:
                raise TimeoutError(
                    f"{', '.join(p[0] for p in pending)} did not serve within "
                    f"{self._start_timeout:g} s."
                )
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        """Stops the processes this object started, and only those."""
        for _, process, _ in self._processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + timeout
        for _, process, _ in self._processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdin is not None:
                process.stdin.close()
        self._processes = []
        if self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def __enter__(self) -> LocalServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve() -> None:
    """Serves the task of `TF_CONFIG` until stopped or standard input closes."""
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server_def = tf.train.ServerDef(
        cluster=resolver.cluster_spec().as_cluster_def(),
        job_name=resolver.task_type,
        task_index=resolver.task_id,
        protocol="grpc",
    )
    # A task behind a relay listens on a port of its own (`listen_ports`).
    if LISTEN_PORT in os.environ:
        server_def.port = int(os.environ[LISTEN_PORT])
    server = tf.distribute.Server(server_def, start=True)

    def exit_at_end_of_stdin() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=exit_at_end_of_stdin, daemon=True).start()
    print(json.dumps({READY: resolver.task_type, "index": resolver.task_id}), flush=True)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.join()


if __name__ == "__main__":
    serve()
