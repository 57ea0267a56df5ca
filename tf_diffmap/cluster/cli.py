"""`python -m tf_diffmap.cluster`: the command line of a cluster's tasks.

`main` serves this machine's worker or ps task (`server.serve`), joins a
running cluster as a worker (`--join`, `member.join_and_serve`), or starts
every worker and ps task on this machine (`--local`,
`foreground.run_local`). It reads its arguments before it imports any of
those, and with them TensorFlow: `--help` and a wrong argument answer at
once (the package loads its names on first use under this command, see
`tf_diffmap/__init__.py`).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main", "parse_local_spec"]

LOCAL_EXAMPLE = "--local workers=2,ps=1"
_SPEC_KEYS = {"workers": "workers", "worker": "workers", "ps": "ps"}


def parse_local_spec(text: str) -> dict[str, int]:
    """Reads a `--local` value such as `workers=2,ps=1` into `LocalCluster` counts.

    A job left out keeps its default (2 workers, 1 ps); `worker` is accepted
    for `workers`.

    Args:
        text: comma-separated `job=count` items.

    Returns:
        `{"workers": ..., "ps": ...}`.

    Raises:
        ValueError: an item that is not `job=count`, an unknown job, a job
            given twice, or a count that is not an integer of at least 1.

    Examples:
        >>> from tf_diffmap.cluster import parse_local_spec
        >>> parse_local_spec("workers=3,ps=2")
        {'workers': 3, 'ps': 2}
    """
    counts = {"workers": 2, "ps": 1}
    seen: set[str] = set()
    example = f"for example {LOCAL_EXAMPLE}"
    for item in text.split(","):
        item = item.strip()
        name, sep, value = item.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise ValueError(
                f"--local {text!r}: {item!r} is not job=count; write the jobs as "
                f"workers=N,ps=M, {example}."
            )
        if name not in _SPEC_KEYS:
            why = (
                " The chief is not started by --local: it is the process that runs "
                "model.fit, with the TF_CONFIG that --local prints."
                if name == "chief"
                else ""
            )
            raise ValueError(
                f"--local {text!r}: unknown job {name!r}; the jobs are 'workers' and 'ps', "
                f"{example}.{why}"
            )
        key = _SPEC_KEYS[name]
        if key in seen:
            raise ValueError(f"--local {text!r}: {key!r} is given twice; give it once, {example}.")
        seen.add(key)
        try:
            count = int(value.strip())
        except ValueError:
            count = None
        if count is None or count < 1:
            raise ValueError(
                f"--local {text!r}: {key} needs a whole number of at least 1, received "
                f"{value.strip()!r}; {example}."
            )
        counts[key] = count
    return counts


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
        metavar="HOST[:PORT]",
        help="with --join and no TF_CONFIG: where the others reach this worker; a host "
        "alone listens on --port, or a free port (default: this host's name)",
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
        from tf_diffmap.cluster.server import serve

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
    from tf_diffmap.cluster.foreground import run_local

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
