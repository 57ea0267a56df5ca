"""Which frame of the stack is the user's, for the `stacklevel` of a warning.

The package's warnings are raised deep below the user's code: at the end of
an epoch, inside Keras' `fit` and TensorFlow's variable reads, or while
TensorFlow traces a step. `warnings.warn` names the frame `stacklevel`
levels up from its caller, and a fixed level names a line of the package.
`user_stacklevel` counts the frames of the package, Keras and TensorFlow
from the function that warns up to the first frame of other code: the
user's call of `fit` (or of whatever started the work). Python 3.12's
`skip_file_prefixes` would do this, but the package supports 3.11.
"""

from __future__ import annotations

import sys

# The packages whose frames stand between the user's code and a warning.
LIBRARY_PACKAGES = ("tf_diffmap", "keras", "tensorflow", "tf_keras")
# Standard modules that run a library's code on its behalf (a `with` block's
# exit, a decorator's wrapper, a thread's start).
LIBRARY_MODULES = ("contextlib", "functools", "threading")


def _is_library(module: str) -> bool:
    package = module.partition(".")[0]
    return package in LIBRARY_PACKAGES or module in LIBRARY_MODULES


def user_stacklevel(fallback: int = 2) -> int:
    """The `stacklevel` for `warnings.warn` that names the user's line.

    Call it from the function that warns, and pass the result on:
    `warnings.warn(message, stacklevel=user_stacklevel())`.

    Args:
        fallback: the level to use when no frame of other code is on the
            stack (a warning given in a thread of the package's own).

    Returns:
        1 for the function that warns, 2 for its caller, and so on up to the
        nearest frame outside tf_diffmap, Keras and TensorFlow.
    """
    frame = sys._getframe(1)  # the function that warns: level 1
    level = 1
    while frame is not None:
        if not _is_library(frame.f_globals.get("__name__", "")):
            return level
        frame = frame.f_back
        level += 1
    return fallback
