"""Work run in threads of its own: outside the caller's graph and scopes, or in the background.

Tracing a replica step from inside Keras' own trace, or making variables
that must not belong to the strategy (the feeds', the gates'), needs a
context with no graph, no `tf.distribute` scope and no lifted scopes: a new
thread has none of the caller's.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Background", "in_clean_thread"]


def in_clean_thread(fn: Callable[[], Any], name: str = "tf_diffmap-trace") -> Any:
    """Runs `fn` in a new thread, outside the caller's graph and scopes.

    Returns:
        What `fn` returned; what it raised is raised here.
    """
    result: dict[str, Any] = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            result["error"] = error

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


class Background:
    """Runs calls one after another in a thread that exits once idle.

    Like the strategy's workers, the thread stops by itself a second after
    its last call, so a `fit` that raised (Keras then skips `on_train_end`)
    leaves no thread behind; the next call starts one again.
    """

    def __init__(self, name: str, idle_seconds: float = 1.0):
        self._name = name
        self._idle_seconds = idle_seconds
        self._calls: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable, *args) -> None:
        with self._lock:
            self._calls.put((fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Returns once every submitted call has returned."""
        self._calls.join()

    def _run(self) -> None:
        while True:
            try:
                fn, args = self._calls.get(timeout=self._idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._calls.empty():
                        self._thread = None
                        return
                continue
            try:
                fn(*args)
            finally:
                self._calls.task_done()
