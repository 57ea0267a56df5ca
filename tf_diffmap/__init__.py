"""tf_diffmap: asynchronous data-parallel training for TensorFlow 2 and Keras 3."""

import importlib
import importlib.util
import os
import sys

# `python -m tf_diffmap.cluster` (a worker or ps server, --join, --local) keeps
# TensorFlow's informational lines out of its output unless
# TF_CPP_MIN_LOG_LEVEL says otherwise: a server logs, for each remote context
# a chief makes on it, its session options as a protocol buffer dump.
# TensorFlow reads the level once, as it loads, and this package's import is
# the only code of the command that runs before TensorFlow's (while Python
# finds a `-m` module, `sys.argv[0]` is "-m").
_COMMAND_LINE = sys.argv[:1] == ["-m"] and "tf_diffmap.cluster" in getattr(sys, "orig_argv", ())
if _COMMAND_LINE:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tf_diffmap needs TensorFlow 2.21 or 2.22, which is not installed. "
        "Install tf_diffmap with its TensorFlow extra: in a clone, "
        'pip install -e ".[cpu]" on a CPU-only host or pip install -e ".[gpu]" '
        "on a GPU host; from a wheel built with python -m build, "
        'pip install "tf_diffmap-0.1.0-py3-none-any.whl[cpu]" (or [gpu]). '
        "tf_diffmap is not on the package index yet."
    )

# Where each name of the package is defined. Under `python -m
# tf_diffmap.cluster` they load on first use, so that the command answers
# `--help` and a wrong argument before TensorFlow loads (seconds); everywhere
# else they are imported here.
_HOMES = {
    "testing": "tf_diffmap.testing",
    "StalenessTensorBoard": "tf_diffmap.callbacks",
    "default_replica_devices": "tf_diffmap.devices",
    "split_devices": "tf_diffmap.devices",
    "WindowStats": "tf_diffmap.store.gate",
    "RowPartitioner": "tf_diffmap.store.partitioned",
    "StalenessStats": "tf_diffmap.store.staleness",
    "Strategy": "tf_diffmap.strategy",
    "AsyncOptimizer": "tf_diffmap.updates.optimizer",
    "staleness_bound": "tf_diffmap.updates.rules",
}

if _COMMAND_LINE:

    def __getattr__(name: str):
        if name not in _HOMES:
            raise AttributeError(f"module 'tf_diffmap' has no attribute {name!r}")
        module = importlib.import_module(_HOMES[name])
        value = getattr(module, name, module)  # `testing` is a module
        globals()[name] = value
        return value

else:
    from tf_diffmap import testing
    from tf_diffmap.callbacks import StalenessTensorBoard
    from tf_diffmap.devices import default_replica_devices, split_devices
    from tf_diffmap.store.gate import WindowStats
    from tf_diffmap.store.partitioned import RowPartitioner
    from tf_diffmap.store.staleness import StalenessStats
    from tf_diffmap.strategy import Strategy
    from tf_diffmap.updates.optimizer import AsyncOptimizer
    from tf_diffmap.updates.rules import staleness_bound

__version__ = "0.1.0"

__all__ = [
    "Strategy",
    "AsyncOptimizer",
    "RowPartitioner",
    "staleness_bound",
    "StalenessStats",
    "WindowStats",
    "StalenessTensorBoard",
    "split_devices",
    "default_replica_devices",
    "testing",
    "__version__",
]
