"""Work run in a thread of its own, outside the caller's graph and scopes.

Tracing a replica step from inside Keras' own trace, or making variables
that must not belong to the strategy (the feeds', the gates'), needs a
context with no graph, no `tf.distribute` scope and no lifted scopes: a new
thread has none of the caller's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["in_clean_thread"]


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
