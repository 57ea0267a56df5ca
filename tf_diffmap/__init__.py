"""tf_diffmap: asynchronous data-parallel training for TensorFlow 2 and Keras 3."""

import importlib.util

if importlib.util.find_spec("tensorflow") is None:
    raise ImportError(
        "tf_diffmap needs TensorFlow 2.21, which is not installed. Install it "
        'with the package: pip install "tf-diffmap[cpu]" on a CPU-only host, '
        'or "tf-diffmap[gpu]" on a GPU host.'
    )

from tf_diffmap import testing
from tf_diffmap.callbacks import StalenessTensorBoard
from tf_diffmap.devices import default_replica_devices, split_devices
from tf_diffmap.optimizer import AsyncOptimizer
from tf_diffmap.partitioned import RowPartitioner
from tf_diffmap.rules import staleness_bound
from tf_diffmap.staleness import StalenessStats
from tf_diffmap.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "Strategy",
    "AsyncOptimizer",
    "RowPartitioner",
    "staleness_bound",
    "StalenessStats",
    "StalenessTensorBoard",
    "split_devices",
    "default_replica_devices",
    "testing",
    "__version__",
]
