"""The examples of the public docstrings run, as doctests, in the test process.

Every public name of `tf_diffmap`, `tf_diffmap.cluster` and
`tf_diffmap.testing` is one test: its docstring's examples and those of its
methods and properties. Each test also checks that at least as many examples
ran as `EXAMPLES` expects, so that an example that vanishes (or is marked
`+SKIP`) fails here rather than going unnoticed.

The examples run in this process, with its four logical CPU devices
(tests/conftest.py): a `tf_diffmap.Strategy()` there has four replicas.
Examples that write files (TensorBoard logs) write them in a temporary
working directory.
"""

from __future__ import annotations

import doctest
import inspect

import pytest

import tf_diffmap
import tf_diffmap.cluster

# Per public name, the fewest examples its docstrings run (`>>>` lines,
# `+SKIP` ones not counted). A public name that is added must be added here.
EXAMPLES = {
    "tf_diffmap": 0,
    "tf_diffmap.Strategy": 6,
    "tf_diffmap.AsyncOptimizer": 8,
    "tf_diffmap.RowPartitioner": 4,
    "tf_diffmap.staleness_bound": 3,
    "tf_diffmap.StalenessStats": 5,
    "tf_diffmap.WindowStats": 3,
    "tf_diffmap.StalenessTensorBoard": 8,
    "tf_diffmap.split_devices": 2,
    "tf_diffmap.default_replica_devices": 3,
    "tf_diffmap.testing": 0,
    "tf_diffmap.testing.ReplicaDelay": 3,
    "tf_diffmap.cluster": 0,
    # LocalCluster's example connects to a cluster: shown, not run (its import
    # runs; tests/test_cluster.py trains on a LocalCluster).
    "tf_diffmap.cluster.CONNECT_TIMEOUT": 0,
    "tf_diffmap.cluster.LocalCluster": 1,
    "tf_diffmap.cluster.PartitionProxy": 5,
    "tf_diffmap.cluster.connect": 0,
    "tf_diffmap.cluster.fail_fast": 0,
    "tf_diffmap.cluster.main": 0,
    "tf_diffmap.cluster.membership_of": 0,
    "tf_diffmap.cluster.parse_local_spec": 2,
    "tf_diffmap.cluster.run_local": 0,
    "tf_diffmap.cluster.serve": 0,
    "tf_diffmap.cluster.strategy_for_cluster": 0,
}

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def public_names() -> dict[str, object]:
    """Each public name, by its dotted path, and what it names.

    A module (`tf_diffmap`, and the public modules it and its public modules
    list) is a name of its own, for its module docstring; so is each name of
    its `__all__`.
    """
    names: dict[str, object] = {}
    modules = [tf_diffmap, tf_diffmap.cluster]
    while modules:
        module = modules.pop(0)
        names[module.__name__] = module
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.ismodule(value):
                modules.append(value)
            elif not name.startswith("__"):
                names[f"{module.__name__}.{name}"] = value
    return names


PUBLIC = public_names()


def test_every_public_name_is_listed():
    assert sorted(PUBLIC) == sorted(EXAMPLES)


def doctests_of(name: str, value) -> list[doctest.DocTest]:
    """The doctests of `value`'s docstring, and of its members' for a class.

    A module's members are public names of their own, so only its docstring
    is taken; a value without a docstring of its own (a constant: its
    docstring is the source's, read by the API reference) has none.
    """
    if not (inspect.ismodule(value) or inspect.isclass(value) or inspect.isroutine(value)):
        return []
    finder = doctest.DocTestFinder(recurse=not inspect.ismodule(value))
    return finder.find(value, name, globs={"__name__": "__main__"})


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    for test in doctests_of(name, PUBLIC[name]):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, f"{results.failed} of {name}'s examples failed (output above)"
    assert results.attempted >= EXAMPLES[name], (
        f"{name}'s docstrings ran {results.attempted} examples; {EXAMPLES[name]} were expected"
    )
