"""A backend's exception as its verdict: the checker calls backends through ``guarded``, which turns
anything they raise but OutOfMemory (and an interrupt) into BackendRaised, with the traceback."""
from __future__ import annotations

import traceback

from kvbench.contract.protocol import OutOfMemory


class BackendRaised(Exception):
    """A backend's call raised something other than OutOfMemory: a FAIL of that backend."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(f"{what} raised {type(error).__name__}: {error}")
        self.what, self.error = what, error
        self.traceback = "".join(traceback.format_exception(error))


def guarded(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with an exception other than OutOfMemory (and an interrupt) turned
    into BackendRaised: a crash of the backend is its verdict, never a crash of the checker."""
    try:
        return fn(*args, **kwargs)
    except (OutOfMemory, KeyboardInterrupt):
        raise
    except Exception as e:
        raise BackendRaised(what, e) from e
