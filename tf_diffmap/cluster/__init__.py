"""Beyond one machine: the strategy on TensorFlow's own distributed runtime.

Replicas become devices of `/job:worker` tasks and the parameter store lives
on `/job:ps` tasks, all reached through `tf.distribute.Server` and gRPC, as
`ParameterServerStrategy` does. The client (`chief`) runs `model.fit`; its
worker threads call each replica's step on its remote device.

On every worker and parameter-server machine, start a server:

```sh
TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' \\
    python -m tf_diffmap.cluster
```

and on the client, with the same cluster and task type `chief`:

```python
strategy = tf_diffmap.cluster.strategy_for_cluster()
```

A server runs until its process is stopped (Ctrl-C or SIGTERM). To try a
cluster on one machine, `python -m tf_diffmap.cluster --local workers=2,ps=1`
or `LocalCluster` start the worker and ps processes.

Its modules: `connect` (the client: `connect`, `strategy_for_cluster`),
`server` (`serve`), `cli` (`main`, the command line, and `parse_local_spec`), `local`
(`LocalCluster`), `launcher` (its servers, forked from one process that
imported TensorFlow), `foreground` (`run_local`: `--local`), `supervisor`
(`--local`'s restarts), `faults` (lost tasks and their replicas:
`ClusterRecord`), `inputs` (input built on the workers: `WorkerInput`),
`membership` (workers that join and leave a running cluster:
`Membership`), `member` (a worker's side of it) and `partition` (a network
partition on one machine, for tests: `PartitionProxy`). A strategy on one
host imports none of them.
"""

import importlib

import tf_diffmap

# Where each name is defined: under `python -m tf_diffmap.cluster` they load
# on first use (see `tf_diffmap/__init__.py`), and `cli` reads the arguments
# before it imports what it runs.
_HOMES = {
    "main": "tf_diffmap.cluster.cli",
    "parse_local_spec": "tf_diffmap.cluster.cli",
    "CONNECT_TIMEOUT": "tf_diffmap.cluster.connect",
    "connect": "tf_diffmap.cluster.connect",
    "fail_fast": "tf_diffmap.cluster.connect",
    "membership_of": "tf_diffmap.cluster.connect",
    "strategy_for_cluster": "tf_diffmap.cluster.connect",
    "run_local": "tf_diffmap.cluster.foreground",
    "LocalCluster": "tf_diffmap.cluster.local",
    "PartitionProxy": "tf_diffmap.cluster.partition",
    "serve": "tf_diffmap.cluster.server",
}

if tf_diffmap._COMMAND_LINE:

    def __getattr__(name: str):
        if name not in _HOMES:
            raise AttributeError(f"module 'tf_diffmap.cluster' has no attribute {name!r}")
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value

else:
    from tf_diffmap.cluster.cli import main, parse_local_spec
    from tf_diffmap.cluster.connect import (
        CONNECT_TIMEOUT,
        connect,
        fail_fast,
        membership_of,
        strategy_for_cluster,
    )
    from tf_diffmap.cluster.foreground import run_local
    from tf_diffmap.cluster.local import LocalCluster
    from tf_diffmap.cluster.partition import PartitionProxy
    from tf_diffmap.cluster.server import serve

__all__ = [
    "CONNECT_TIMEOUT",
    "LocalCluster",
    "PartitionProxy",
    "connect",
    "fail_fast",
    "main",
    "membership_of",
    "parse_local_spec",
    "run_local",
    "serve",
    "strategy_for_cluster",
]
