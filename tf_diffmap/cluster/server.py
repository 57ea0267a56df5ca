"""The tasks' side of a cluster: serving a worker or ps task, the command line.

`serve` runs this machine's worker or ps server from its TF_CONFIG until the
process is stopped; `main` is `python -m tf_diffmap.cluster`, which serves
one task, or with `--local` starts every worker and ps task on this machine
(`local.run_local`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

import tensorflow as tf

from tf_diffmap.cluster.connect import fail_fast, resolve_cluster
from tf_diffmap.cluster.local import parse_local_spec, run_local

__all__ = ["check_server", "main", "serve", "start_server"]


def serve(
    config: str | None = None,
    logical_cpus: int = 1,
    exit_when_stdin_closes: bool = False,
    port: int | None = None,
) -> None:
    """Runs this machine's worker or ps server until the process is stopped.

    Ctrl-C (SIGINT) and SIGTERM stop it.

    Args:
        config: a TF_CONFIG JSON string; by default the `TF_CONFIG` variable.
        logical_cpus: logical CPU devices to make of the CPU before serving, so
            that a worker task without GPUs holds that many replicas.
        exit_when_stdin_closes: exit once standard input reaches its end, so
            that a server started through a pipe (as `LocalCluster` does) does
            not outlive the process that started it.
        port: the port to listen on, when the others reach this task at
            another address (a relay in front of it, as `PartitionProxy`
            is); by default the port of its address in the cluster.

    Raises:
        ValueError: no TF_CONFIG, a task type other than worker or ps, a
            task that its cluster does not list, or `logical_cpus` below 1.
    """
    if not isinstance(logical_cpus, int) or logical_cpus < 1:
        raise ValueError(f"logical_cpus must be an integer >= 1, received {logical_cpus!r}.")
    if config is not None:
        os.environ["TF_CONFIG"] = config
    resolver = resolve_cluster()
    check_server(resolver)
    server = start_server(
        resolver.cluster_spec(),
        resolver.task_type,
        resolver.task_id,
        logical_cpus,
        port,
        exit_when_stdin_closes,
        resolver.rpc_layer or "grpc",
    )
    # `join` blocks in C++, where Python never sees the KeyboardInterrupt of a
    # Ctrl-C; the default action ends the process instead.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    server.join()


def start_server(
    cluster: tf.train.ClusterSpec,
    job: str,
    index: int,
    logical_cpus: int = 1,
    port: int | None = None,
    exit_when_stdin_closes: bool = False,
    protocol: str = "grpc",
) -> tf.distribute.Server:
    """Starts this task's server and says so on standard output (one JSON
    line with `"serving"`, which `LocalCluster` waits for).

    Args:
        cluster: the cluster, which names this task.
        job: this task's job.
        index: this task's index.
        logical_cpus: logical CPU devices to make of the CPU.
        port: a port to listen on other than the one of its address.
        exit_when_stdin_closes: exit once standard input reaches its end.
        protocol: the RPC layer.

    Returns:
        The running server.
    """
    # The server makes its devices from its own session config, not from
    # tf.config's logical device configuration.
    fail_fast()
    session_config = None
    if logical_cpus > 1:
        session_config = tf.compat.v1.ConfigProto(device_count={"CPU": logical_cpus})
    server_def = tf.train.ServerDef(
        cluster=cluster.as_cluster_def(), job_name=job, task_index=index, protocol=protocol
    )
    if port is not None:
        server_def.port = port
    server = tf.distribute.Server(server_def, config=session_config, start=True)
    if exit_when_stdin_closes:
        threading.Thread(target=_exit_at_end_of_stdin, daemon=True).start()
    print(json.dumps({"serving": job, "index": index, "target": server.target}), flush=True)
    return server


def check_server(resolver: tf.distribute.cluster_resolver.ClusterResolver) -> None:
    """Checks that the cluster names a worker or ps task for this process to serve.

    What `serve` requires of TF_CONFIG before it starts a server; starts
    nothing.

    Args:
        resolver: a `tf.distribute.cluster_resolver.ClusterResolver`.

    Raises:
        ValueError: a task type other than worker or ps, or a task that the
            cluster does not list.
    """
    if resolver.task_type not in ("worker", "ps"):
        raise ValueError(
            f"`python -m tf_diffmap.cluster` serves worker and ps tasks; TF_CONFIG "
            f"names task type {resolver.task_type!r}."
        )
    jobs = resolver.cluster_spec().as_dict()
    tasks = jobs.get(resolver.task_type, [])
    indices = list(tasks) if isinstance(tasks, dict) else range(len(tasks))
    if resolver.task_id not in indices:
        raise ValueError(
            f"TF_CONFIG names task {resolver.task_type!r} {resolver.task_id!r}, which its "
            f"cluster does not list ({resolver.task_type!r} tasks: {list(indices)}); give "
            "the index of this task's address in cluster."
        )


def _exit_at_end_of_stdin() -> None:
    sys.stdin.buffer.read()
    print("Standard input closed: the process that started this server is gone.", file=sys.stderr)
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    """`python -m tf_diffmap.cluster`: serve one task, or try a cluster locally.

    Args:
        argv: the arguments; by default `sys.argv[1:]`.

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m tf_diffmap.cluster",
        description=(
            "Serve this machine's tf_diffmap worker or ps task (from TF_CONFIG) until "
            "stopped, or with --local start every worker and ps task on this machine "
            "(and with -- COMMAND, run COMMAND as the chief, for example -- python train.py)."
        ),
    )
    parser.add_argument("--tf-config", default=None, help="TF_CONFIG JSON (default: $TF_CONFIG)")
    parser.add_argument(
        "--local",
        nargs="?",
        const="workers=2,ps=1",
        default=None,
        metavar="workers=N,ps=M",
        help=(
            "start N worker and M ps processes on 127.0.0.1, print the TF_CONFIG a chief "
            "must use, and run until Ctrl-C or SIGTERM (default: workers=2,ps=1)"
        ),
    )
    parser.add_argument(
        "--logical-cpus",
        type=int,
        default=1,
        metavar="N",
        help="logical CPU devices per worker task, one replica each (default: 1)",
    )
    parser.add_argument(
        "--exit-when-stdin-closes",
        action="store_true",
        help="stop serving when standard input ends (used by LocalCluster)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="listen on this port instead of the one of this task's address in TF_CONFIG "
        "(when the others reach it through a relay)",
    )
    parser.add_argument(
        "--join",
        nargs="?",
        const="",
        default=None,
        metavar="CHIEF_ENDPOINT",
        help="join a running cluster through the chief's membership endpoint (HOST:PORT; "
        "by default TF_CONFIG's chief at its port + 1), serve, and leave it on SIGTERM: with "
        "TF_CONFIG as the worker it names, without one at --address in a slot the chief gives",
    )
    parser.add_argument(
        "--address",
        default=None,
        metavar="HOST:PORT",
        help="with --join and no TF_CONFIG: where the others reach this worker "
        "(default: this host's name and a free port)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        metavar="N",
        help="with --local: start a task that exits again, and the chief command when it "
        "fails, up to N times each (default: 3; 0: never)",
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    command = None
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :] or None
    args = parser.parse_args(argv)
    if args.logical_cpus < 1:
        parser.error(f"--logical-cpus needs N >= 1, received {args.logical_cpus}.")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts needs N >= 0, received {args.max_restarts}.")
    if command is not None and args.local is None:
        parser.error("A command after -- is run as the chief of --local; add --local.")
    if args.join is not None:
        if args.local is not None:
            parser.error("--join serves one worker; it does not go with --local.")
        from tf_diffmap.cluster.member import join_and_serve

        try:
            return join_and_serve(
                membership=args.join or None,
                address=args.address,
                config=args.tf_config,
                logical_cpus=args.logical_cpus,
                port=args.port,
                exit_when_stdin_closes=args.exit_when_stdin_closes,
            )
        except ValueError as error:
            parser.error(str(error))
    if args.address is not None:
        parser.error("--address goes with --join.")
    if args.local is None:
        serve(args.tf_config, args.logical_cpus, args.exit_when_stdin_closes, args.port)
        return 0
    if args.tf_config is not None:
        parser.error(
            "--local starts its own tasks and prints their TF_CONFIG; drop --tf-config, "
            "for example: python -m tf_diffmap.cluster --local workers=2,ps=1"
        )
    try:
        counts = parse_local_spec(args.local)
    except ValueError as error:
        parser.error(str(error))
    try:
        return run_local(
            **counts,
            cpus_per_worker=args.logical_cpus,
            max_restarts=args.max_restarts,
            command=command,
        )
    except (RuntimeError, TimeoutError) as error:
        print(f"python -m tf_diffmap.cluster --local: {error}", file=sys.stderr)
        return 1
