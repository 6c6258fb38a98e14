"""A backend's fault as its verdict: the checker calls backends through ``guarded``, which turns
whatever a call raises but OutOfMemory into BackendRaised, with the traceback: an exception of any
class, SystemExit and KeyboardInterrupt included, and a call that runs past the time limit.

Only the user's own interrupt goes through. Inside :func:`watching` (the checker enters it), the
main thread's SIGINT and SIGTERM handlers note that a signal came before raising as they did:
a KeyboardInterrupt with no such note was raised by the backend's code. The time limit is a
one-shot SIGALRM timer around each call whose handler raises OpTimeout inside it. A thread
cannot be stopped from outside in Python, and running each call in a worker thread to abandon
it would cost a hand-off per call and leave the abandoned call writing into the backend; the
alarm costs a setitimer per call and stops a call stuck in Python code or in a blocking system
call (a C loop that never checks for signals is stopped when it returns). Signals are the main
thread's: in another thread no call is timed, and every KeyboardInterrupt is the backend's.
"""
from __future__ import annotations

import signal
import threading
import traceback
from contextlib import contextmanager

from kvbench.contract import registry
from kvbench.contract.protocol import OutOfMemory

DEFAULT_OP_TIMEOUT = 60.0  # seconds a backend call may take: generous (0 or None: no limit)


class BackendRaised(Exception):
    """A backend's call raised something other than OutOfMemory: a FAIL of that backend."""

    def __init__(self, what: str, error: BaseException):
        super().__init__(f"{what} raised {described(error)}")
        self.what, self.error = what, error
        self.traceback = "".join(traceback.format_exception(error))


class OpTimeout(BaseException):
    """A backend call ran past the time limit (raised inside it by the alarm): a BaseException,
    so that the backend's own ``except Exception`` does not swallow it."""

    def __init__(self, seconds: float):
        super().__init__(f"no return within {seconds:g} s (the time limit of one backend call: "
                         f"--op-timeout)")


class BadReturn(Exception):
    """A backend call returned what it must not (a ledger that is a str, victims that are an
    int): its FAIL, named by the call, what it returned and what it should have."""

    def __init__(self, what: str, value, wanted: str):
        super().__init__(f"{what} returned {shown(value)}, not {wanted}")
        self.what, self.value, self.wanted = what, value, wanted


def described(error: BaseException) -> str:
    """'RuntimeError: boom'; 'KeyboardInterrupt' where it says nothing more."""
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def shown(value, width: int = 80) -> str:
    """``value`` as a verdict names a wrong return: its repr, cut to ``width``, and its type."""
    text = repr(value)
    text = text if len(text) <= width else text[:width - 3] + "..."
    kind = type(value).__name__
    return f"{text} ({'an' if kind[0] in 'aeiou' else 'a'} {kind})"


class _State(threading.local):
    depth = 0  # watching() entered, nested
    live = False  # a guarded call is running: the alarm raises inside it
    timeout = 0.0  # seconds; 0: calls are not timed
    interrupted = False  # a SIGINT or SIGTERM came since watching() began


_state = _State()


def _noting(previous):
    def handler(signum, frame):
        _state.interrupted = True
        return previous(signum, frame)
    return handler


def _expired(signum, frame):
    if _state.live:  # else the call returned just before: nothing to stop
        raise OpTimeout(_state.timeout)


@contextmanager
def watching(op_timeout: float | None = DEFAULT_OP_TIMEOUT):
    """Backend calls made inside are timed (``op_timeout`` seconds; 0 or None: not timed), and a
    user's interrupt is told from the backend's. Nested: the outermost's limit holds. In the
    main thread only; where another owner holds SIGALRM or its timer, calls are not timed."""
    st = _state
    if st.depth:
        st.depth += 1
        try:
            yield
        finally:
            st.depth -= 1
        return
    saved = {}
    if threading.current_thread() is threading.main_thread():
        st.interrupted = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.getsignal(sig)
            if callable(previous):  # a Python handler raises the interrupt; else none comes
                saved[sig] = previous
                signal.signal(sig, _noting(previous))
        if op_timeout and signal.getsignal(signal.SIGALRM) == signal.SIG_DFL \
                and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0):
            saved[signal.SIGALRM] = signal.SIG_DFL
            signal.signal(signal.SIGALRM, _expired)
            st.timeout = float(op_timeout)
    st.depth = 1
    try:
        yield
    finally:
        st.depth, st.timeout = 0, 0.0
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def guarded(what: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, with anything it raises but OutOfMemory (and the user's interrupt)
    turned into BackendRaised: a crash of the backend is its verdict, never a crash of the checker
    nor an exit of kvbench. Inside :func:`watching`, a call past its time limit raises OpTimeout."""
    st = _state
    if st.live:  # a backend call inside a backend call: the outer one times and guards both
        return fn(*args, **kwargs)
    timed = st.timeout
    if timed:
        signal.setitimer(signal.ITIMER_REAL, timed)
    st.live = True
    try:
        result = fn(*args, **kwargs)
        st.live = False  # before any call: from here the alarm raises nothing
        return result
    except BaseException as e:
        st.live = False
        if isinstance(e, OutOfMemory) or (isinstance(e, KeyboardInterrupt) and st.interrupted):
            raise  # a refusal, the contract's; or the user's Ctrl-C or SIGTERM
        raise BackendRaised(what, e) from e
    finally:
        st.live = False
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)


def make(name: str, config):
    """The registry's backend ``name`` for ``config``, made under :func:`guarded`: a refusal of
    the settings raises BackendUnavailable as it is (the caller's n/a or usage error), and
    anything else its factory raises is the backend's fault (BackendRaised of ``__init__``),
    never read as kvbench's own error."""
    try:
        return guarded("__init__", registry.resolve(name).create, config)
    except BackendRaised as e:
        if isinstance(e.error, registry.BackendUnavailable):
            raise e.error from None
        raise
