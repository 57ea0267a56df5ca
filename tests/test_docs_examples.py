"""The README's and the documentation pages' code, and the output they show.

The doctests cover the docstrings; these cover the pages (tests/docs_blocks.py
says how a block that cannot run alone is marked). The fast tests compile
every Python block and compare each statistics sample with the format
`StalenessStats` prints; the slow ones run every block not marked, in a
process of its own, outside the clone, and compare what it prints.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from docs_blocks import (
    PAGES,
    ROOT,
    STATISTICS_START,
    blocks,
    python_blocks,
    readme_quick_start,
    shape,
    statistics_samples,
)

import tf_diffmap


def _stats(dropped=False, lr_scale=False, steps=None) -> tf_diffmap.StalenessStats:
    updates = np.array([3, 1])
    return tf_diffmap.StalenessStats(
        version=4,
        updates=updates,
        dropped=np.array([1, 0]) if dropped else np.zeros(2, np.int64),
        staleness_sum=np.array([3, 2]),
        staleness_max=np.array([2, 2]),
        histogram=np.array([[1, 1, 1], [0, 0, 1]]),
        lr_scale_sum=np.array([1.5, 0.5]) if lr_scale else None,
        steps=steps,
        step_staleness_sum=np.array([1, 0]),
        step_staleness_max=np.array([1, 0]),
        step_histogram=np.array([[2, 1, 0], [1, 0, 0]]),
    )


def printed_shapes() -> tuple[set[str], set[str]]:
    """The shapes of the first line `print(strategy.statistics())` prints
    (gradients aggregated into steps, and every gradient a step), and those
    of its replica lines, with and without dropped updates and a
    learning-rate factor."""
    variants = [
        str(_stats(d, s, steps)).splitlines()
        for d in (False, True)
        for s in (False, True)
        for steps in (None, 2)
    ]
    firsts = {shape(lines[0]) for lines in variants}
    return firsts, {shape(line) for lines in variants for line in lines[1:]}


def check_statistics(lines: list[str], where: str) -> None:
    """Fails unless `lines` (a statistics block) have the printed format."""
    firsts, replica_lines = printed_shapes()
    assert shape(lines[0]) in firsts, (
        f"{where}: the first line has another format than the code prints:\n"
        f"  shown:   {lines[0]}\n  printed: {str(_stats()).splitlines()[0]}"
    )
    for line in lines[1:]:
        if line.strip() == "...":  # rows left out
            continue
        assert shape(line) in replica_lines, f"{where}: no printed line has the format of {line!r}"


def test_every_python_block_compiles():
    found = python_blocks()
    assert len(found) >= 10
    for block in found:
        compile(block.code, str(block), "exec")


# The site shows about 82 characters of a code line at its narrowest; a
# Python block does not wrap (stylesheets/extra.css), so a longer line is cut.
SITE_CODE_WIDTH = 80


def test_python_lines_fit_the_sites_code_blocks():
    long = [
        f"{block} line {i + 1}: {len(line)} characters"
        for block in python_blocks()
        for i, line in enumerate(block.code.splitlines())
        if len(line) > SITE_CODE_WIDTH
    ]
    assert long == []


def test_the_tf_config_lines_of_beyond_one_machine_parse_in_sh(tmp_path):
    (block,) = [b for b in blocks(ROOT / "docs" / "cluster.md") if "TF_CONFIG='" in b.code]
    # `python` reads TF_CONFIG as the task would and prints its task.
    shim = (
        'python() { "$PYTHON" -c \'import json, os; c = json.loads(os.environ["TF_CONFIG"]); '
        'print(c["task"]["type"], c["task"]["index"], sorted(c["cluster"]))\'; }\n'
    )
    script = tmp_path / "tf_config.sh"
    script.write_text(shim + block.code, encoding="utf-8")
    result = subprocess.run(
        ["sh", str(script)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    tasks = ["worker 0", "worker 1", "ps 0", "chief 0"]
    assert result.stdout.splitlines() == [f"{t} ['chief', 'ps', 'worker']" for t in tasks]


def test_the_quick_start_of_getting_started_is_the_readmes():
    first_model = [b for b in blocks(ROOT / "docs" / "getting-started.md") if b.lang == "python"][0]
    assert first_model.code == readme_quick_start()


def test_statistics_samples_have_the_format_the_code_prints():
    samples = statistics_samples()
    assert {b.page.name for b in samples} >= {"README.md", "getting-started.md"}
    for block in samples:
        check_statistics(block.code.splitlines(), str(block))


def test_a_sample_without_the_momentum_part_is_caught():
    old = [
        "store version 920; mean staleness 1.98, max 5",
        "  replica 0: 236 updates (25.7%), mean staleness 1.89, max 5",
    ]
    with pytest.raises(AssertionError, match="another format"):
        check_statistics(old, "the README before the fix")


# An install from the package index, where the package is not published.
INDEX_INSTALL = re.compile(r"pip install\s+(\"|')?tf-diffmap\b")


def test_no_page_installs_from_the_package_index():
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in INDEX_INSTALL.finditer(text):
            after = " ".join(text[match.end() : match.end() + 40].split())
            assert after.startswith("` finds no distribution"), (
                f"{page.relative_to(ROOT)}: {text[match.start() : match.end() + 40]!r} "
                "installs from the package index, where tf_diffmap is not published"
            )


def test_without_tensorflow_the_import_error_says_how_to_install():
    hide_tensorflow = (
        "import importlib.util as u; find = u.find_spec; "
        "u.find_spec = lambda name, *a: None if name == 'tensorflow' else find(name, *a); "
        "import tf_diffmap"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_tensorflow], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: tf_diffmap needs TensorFlow 2.21 or 2.22")
    assert 'pip install -e ".[cpu]"' in message and "not on the package index" in message
    assert "tf-diffmap[" not in message


def _runnable():
    seen = {}
    for block in python_blocks():
        if block.not_run is None and block.code not in seen:
            seen[block.code] = block
    return list(seen.values())


@pytest.mark.slow
@pytest.mark.parametrize("block", _runnable(), ids=str)
def test_runnable_blocks_run_and_print_what_the_pages_show(block, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block.code, encoding="utf-8")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,  # outside the clone, as a user's script
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, f"{block} failed:\n{result.stderr[-4000:]}"
    lines = result.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(STATISTICS_START)]
    for start in starts:
        end = start + 1
        while end < len(lines) and lines[end].startswith("  replica "):
            end += 1
        assert end > start + 1, f"{block} printed statistics without replica lines"
        check_statistics(lines[start:end], f"{block}'s output")
    if block.prints is not None:
        assert lines and lines[-1] == block.prints, f"{block} printed {lines[-3:]}"
