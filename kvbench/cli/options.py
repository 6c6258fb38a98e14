"""What every kvbench command line shares: one error path and option types that refuse a bad value
before any work starts.

Every entry point (``kvbench``, ``python -m kvbench.cli``, ``python -m kvbench.cli.gates``,
``python -m kvbench.cli.gpu``, ``python -m kvbench.bench.compare``) runs through :func:`run`:

- a bad option or input prints one line, ``kvbench: error: FILE:LINE: reason`` or
  ``kvbench: error: --option: reason``, and exits 2, never with a traceback;
- Ctrl-C prints ``kvbench: interrupted`` and exits 130, SIGTERM ``kvbench: terminated`` and 143
  (outputs are written to temporary names and renamed when complete: kvbench.outputs, so no
  half-written file is left; `run` keeps the runs it finished in a record marked partial);
- ``--debug`` anywhere on the line prints the traceback as well.

Exit codes: 0 every check passed; 1 a check FAILed; 2 an error (bad input, a backend that cannot
run, the harness could not check, nothing passed); 130 interrupted; 143 terminated.
"""
from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
import traceback
import warnings

from kvbench.checking.raised import BackendRaised
from kvbench.contract.formulas import MAX_BLOCK_SIZE
from kvbench.contract import registry
from kvbench.contract.registry import BackendUnavailable

EXIT_OK, EXIT_FAIL, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# Errors a user's input or machine causes: one line, no "internal" and no hint.
USER_ERRORS = (ValueError, OSError, LookupError, MemoryError, BackendUnavailable)


class UsageError(ValueError):
    """A bad option or input, reported as one line (``--option: reason``), exit 2."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is: it stops as on Ctrl-C, keeping what it finished."""


def _raise_terminated(signum, frame):
    raise Terminated


def stop_word(stop: KeyboardInterrupt) -> str:
    """What stopped a command, as every command says it: 'terminated' (SIGTERM) or 'interrupted'."""
    return "terminated" if isinstance(stop, Terminated) else "interrupted"


class Parser(argparse.ArgumentParser):
    """argparse's own errors (unknown option, bad choice, a type's refusal) as a UsageError, so
    they take the one error path: ``kvbench: error: --block-size: must be ... (see --help)``."""

    def error(self, message):
        if message.startswith("argument "):
            message = message[len("argument "):]
        raise UsageError(f"{message} (see {self.prog} --help)")


INT64_MAX = (1 << 63) - 1  # counts and ids are stored as int64


def positive_int(text: str, maximum: int = INT64_MAX) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"must be at most {maximum:,}, got {value}")
    return value


def block_size(text: str) -> int:
    """Tokens per block: a positive integer up to MAX_BLOCK_SIZE."""
    return positive_int(text, MAX_BLOCK_SIZE)


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def seconds(text: str) -> float:
    """A time limit in seconds: a finite number >= 0 (0: none)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def describe(error: BaseException) -> str:
    """One line for an error: an OSError names its file; a MemoryError says it is memory."""
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        return f"{error.filename}: {error.strerror}"
    if isinstance(error, MemoryError):
        return f"out of memory ({error or 'MemoryError'})"
    text = str(error).strip().replace("\n", " ") or type(error).__name__
    if isinstance(error, USER_ERRORS):
        return text
    return f"{type(error).__name__}: {text}"


def add_format_arg(parser, *, native: bool = True, default: str | None = None,
                   of: str = "the trace") -> None:
    """``--format``, the one definition every command that reads a trace shares: kvbench's own
    JSONL / CSV (``kvbench``), or a public request trace through its loader
    (kvbench.traces.loaders, docs/trace-format.md "Real traces: --format"). ``native=False``: the
    command needs requests (their lengths, arrivals, block hashes), not operations."""
    from kvbench.traces.loaders import LOADERS, NATIVE, trace_formats
    formats = trace_formats() if native else list(LOADERS)
    public = f"a public request trace ({', '.join(LOADERS)})"
    text = (f"format of {of}: {NATIVE} (its own JSONL or CSV of operations, the default) or "
            f"{public}, replayed request after request: prefill with its block hashes, output, "
            f"free (docs/trace-format.md)" if native else
            f"format of {of}: {public}; docs/trace-format.md")
    parser.add_argument("--format", choices=formats, default=default, metavar="FORMAT",
                        help=text + (f" (default {default})" if default else ""))


def runnable_backend(spec: str, option: str = "--backend"):
    """The registry entry of ``spec`` (a name or package.module:Class) that can run here; a
    UsageError naming ``option`` when it is unknown or cannot."""
    try:
        entry = registry.resolve(spec)
    except ValueError as e:
        raise UsageError(f"{option} {spec}: {e}") from None
    ok, why = entry.available()
    if not ok:
        raise UsageError(f"{option} {spec}: cannot run here: {why}")
    return entry


class _UntilTheReaderLeaves:
    """A command's stdout: when its reader goes (``kvbench list | head``), the rest of the output
    is dropped, stdout pointed at os.devnull as Python's documentation on SIGPIPE advises, and the
    command ends with the exit code it would have had."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            _drop_stdout(self._stream)
            return len(text)

    def flush(self):
        try:
            self._stream.flush()
        except BrokenPipeError:
            _drop_stdout(self._stream)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _drop_stdout(stream) -> None:
    """Point ``stream``'s descriptor at os.devnull: what is left to write goes nowhere."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor (a test's)
        pass


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    """kvbench's own warnings as one line, as its errors are; others as Python shows them."""
    if category.__module__.startswith("kvbench"):
        return f"kvbench: warning: {message}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_PYTHON_FORMAT = warnings.formatwarning


def run(command, argv=None, prog: str = "kvbench") -> int:
    """``command(argv)`` with the one error path: the exit code, never a traceback (unless
    ``--debug`` is among the arguments, which is taken out before ``command`` sees them)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    main_thread = threading.current_thread() is threading.main_thread()
    warnings.formatwarning = _one_line_warning
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
    stdout = sys.stdout
    sys.stdout = _UntilTheReaderLeaves(stdout)
    try:
        return command(argv)
    except KeyboardInterrupt as e:
        if debug:
            traceback.print_exc()
        print(f"{prog}: {stop_word(e)}", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(e, Terminated) else EXIT_INTERRUPTED
    except BrokenPipeError:  # a write to stdout's bytes (a record, `--output - | head`) whose
        # reader left: the command did not finish
        _drop_stdout(stdout)
        print(f"{prog}: error: standard output closed before the command finished", file=sys.stderr)
        return EXIT_ERROR
    except BackendRaised as e:  # a backend crashed outside a check (its making): its FAIL
        if debug:
            traceback.print_exc()
        print(f"{prog}: FAIL: the backend's fault: {e}", file=sys.stderr)
        return EXIT_FAIL
    except Exception as e:
        if debug:
            traceback.print_exc()
        hint = "" if debug else " (--debug shows the traceback)"
        kind = "" if isinstance(e, USER_ERRORS) else "internal "
        print(f"{prog}: {kind}error: {describe(e)}" + (hint if kind else ""), file=sys.stderr)
        return EXIT_ERROR
    finally:
        sys.stdout.flush()  # what is buffered, while a reader that left is still handled
        sys.stdout = stdout
        if main_thread:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
