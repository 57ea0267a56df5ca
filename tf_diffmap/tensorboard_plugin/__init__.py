"""The Staleness dashboard for TensorBoard, and the summaries it reads.

`tf_diffmap.StalenessTensorBoard` writes the summaries (`summary.py`, of the
figures `figures.py` makes, with the names and formats in `metadata.py`);
`plugin.py` is the TensorBoard plugin that
draws them in a "Staleness" tab, with its browser code in `static/`. The
package installs the plugin through the `tensorboard_plugins` entry point, so
`tensorboard --logdir` and `%tensorboard` find it by themselves.

Nothing is imported here: TensorBoard loads `plugin.py` on its own, and the
callback needs only `metadata.py` and `summary.py`.
"""
