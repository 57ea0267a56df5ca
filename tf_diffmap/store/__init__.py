"""The store: the variables, their versions and what accumulates beside them.

The parameter store with its version counter and staleness counters
(`parameter_store`), tables split by rows over several devices
(`partitioned`), row reads and locked row writes (`rows`), the
accumulators of asynchronous mini-batching (`accumulators`), consistent
snapshots for evaluation and saving (`snapshots`), and the statistics read
from the counters (`staleness`). Nothing here depends on the layers above.
"""
