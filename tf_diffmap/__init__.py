"""tf_diffmap: asynchronous data-parallel training for TensorFlow 2 and Keras 3."""

from tf_diffmap import testing
from tf_diffmap.devices import default_replica_devices, split_devices
from tf_diffmap.optimizer import AsyncOptimizer
from tf_diffmap.staleness import StalenessStats, staleness_bound
from tf_diffmap.strategy import Strategy

__version__ = "0.1.0"

__all__ = [
    "Strategy",
    "AsyncOptimizer",
    "staleness_bound",
    "StalenessStats",
    "split_devices",
    "default_replica_devices",
    "testing",
    "__version__",
]
