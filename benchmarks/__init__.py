"""Benchmarks of `tf_diffmap` against the strategies a Keras user would pick instead.

Run the suite with `python -m benchmarks` (add `--quick` for a run of a few
minutes); it writes `results.json`, `results.md` and PNG plots to
`benchmarks/results/` (or `--out DIR`).

Each contender configuration runs in its own subprocess (`benchmarks.worker`),
because logical CPU devices can only be made before TensorFlow initializes;
the parent (`benchmarks.suite`) interleaves the contenders across repeats and
reports medians. What each table shows is in `docs/benchmarks.md`. Modules:

- `plan`: what a full, quick or smoke run measures (presets, one place);
- `workloads`: data sets and models, shared by Keras 3 and tf-keras;
- `contenders`: the strategies compared, and how each is built;
- `servers`: plain `tf.distribute.Server`s on localhost, for tf-keras'
  ParameterServerStrategy;
- `worker`: runs one session (one contender, one device count) and prints JSON;
- `suite`: the command line, calibration, interleaved repeats;
- `timeline`: the fault timeline's threads (sampling the strategy's counters,
  killing and restarting a worker) and its arithmetic (rates per second);
- `report`: medians, the targets, and the tables of `results.md`;
- `plots`: the PNG figures;
- `checkouts`: the replicas' loops of two checkouts of tf_diffmap, side by side.
- `push_profile`: one global batch's remote calls, bytes and ps kernels on a
  localhost cluster, beside ParameterServerStrategy's, with `wire` (a relay
  per task that reads the gRPC calls passing it) and `traces` (TensorFlow's
  profiler on every task, read back, and the timeline figure).
- `examples`: keras-io and keras-rs examples run as written (plain Keras,
  MirroredStrategy, tf_diffmap), with `example_edits` (the listed edits of
  their source) and `example_data` (synthetic data in place of downloads).

Nothing in this package is imported by `tf_diffmap` itself, and importing
`benchmarks` does not import TensorFlow.
"""

__all__: list[str] = []
