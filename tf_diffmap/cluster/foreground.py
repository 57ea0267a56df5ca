"""A cluster on one machine in the foreground: `python -m tf_diffmap.cluster --local`.

`run_local` starts the cluster that the `--local` value asks for
(`cli.parse_local_spec`), prints what a chief needs, and keeps its tasks
running (`supervisor.Supervisor`) until Ctrl-C or SIGTERM, or, given the
training script's command, until that chief succeeds.
"""

from __future__ import annotations

import signal
import time

from tf_diffmap.cluster.local import SERVER_JOBS, LocalCluster
from tf_diffmap.cluster.supervisor import Supervisor

__all__ = ["run_local"]


class _Stop(Exception):
    """SIGTERM, turned into an exception so that the cluster is stopped in order."""


def _raise_stop(signum, frame) -> None:
    raise _Stop()


def run_local(
    workers: int = 2,
    ps: int = 1,
    cpus_per_worker: int = 1,
    max_restarts: int = 3,
    command: list[str] | None = None,
) -> int:
    """Runs a `LocalCluster` in the foreground until Ctrl-C or SIGTERM.

    Prints each task's address, pid and TF_CONFIG (the chief's last, as
    one JSON line), then keeps the servers running: a task that exits is
    started again at its address, up to `max_restarts` times
    (`supervisor.Supervisor`), and each restart is reported. With a
    `command`, it runs it as the chief, again when it fails (up to
    `max_restarts` times), and stops once it succeeds.

    Args:
        workers: worker tasks.
        ps: ps tasks.
        cpus_per_worker: logical CPU devices per worker task.
        max_restarts: restarts of each task and of the chief; 0: none.
        command: the training script's command line, run as the chief.

    Returns:
        The exit status: 0 once stopped by Ctrl-C or SIGTERM or once the
        command succeeded, else the command's last status.
    """
    local = LocalCluster(workers, ps, chief=True, cpus_per_worker=cpus_per_worker)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _raise_stop)
    status = 0
    supervisor = None
    try:
        local.start()
        pids = local.pids
        for job in SERVER_JOBS:
            for index, address in enumerate(local.cluster_spec[job]):
                print(f"{job} {index}  {address}  pid {pids[(job, index)]}")
                print(f"  TF_CONFIG={local.tf_config(job, index)}")
        chief = "started below" if command else "not started: your training process"
        print(f"chief 0  {local.cluster_spec['chief'][0]}  ({chief})")
        print(f"logs in {local.log_dir}")
        print("# TF_CONFIG for the chief, the process that runs model.fit:")
        print(local.tf_config("chief", 0))
        if command:
            print(f"Running the chief, restarting it and any task up to {max_restarts} times.")
        else:
            print(
                f"Serving until Ctrl-C or SIGTERM; a task that exits starts again "
                f"(up to {max_restarts} times).",
                flush=True,
            )
        supervisor = Supervisor(local, max_restarts, command)
        if command:
            supervisor.start_chief()
        while True:
            time.sleep(0.5)
            result = supervisor.poll()
            if result is not None:
                status = result
                break
    except (KeyboardInterrupt, _Stop):
        pass
    finally:
        # A second Ctrl-C or SIGTERM must not cut the stopping short.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        if supervisor is not None:
            supervisor.stop_chief()
        local.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("Stopped the cluster's processes.", flush=True)
    return status
