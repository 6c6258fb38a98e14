"""The `kvbench` command: run, check, serve, gen, prefix, compare, gates, list, eviction, faults,
shrink, fuzz, sweep, results.

Each command group lives in a module of its own with a ``register(subparsers)`` function;
this module only puts them together. Errors take the one path of kvbench.cli.options: one line,
exit 2 (130 on Ctrl-C); ``--debug`` anywhere shows the traceback.
"""
from __future__ import annotations

import importlib
import sys

from kvbench.cli import options

# Each command group's register function, imported when the parser is built (so that
# `python -m kvbench.cli.gates` finds its module not yet imported by this package).
REGISTER = ("kvbench.cli.run:register", "kvbench.cli.data:register_gen_prefix",
            "kvbench.bench.compare:add_compare_parser", "kvbench.cli.gates:register",
            "kvbench.cli.data:register_list", "kvbench.cli.eviction:register",
            "kvbench.cli.faults:register", "kvbench.cli.sweep:register",
            "kvbench.cli.shrink:register", "kvbench.cli.fuzz:register",
            "kvbench.cli.serve:register")

EPILOG = ("exit status: 0 every check passed, 1 a check FAILed, 2 an error (bad input, a backend "
          "that cannot run, nothing checked or passed), 130 interrupted. --debug (anywhere on the "
          "line) shows the traceback of an error.")


def parser() -> options.Parser:
    p = options.Parser(prog="kvbench", description=__doc__.splitlines()[0], epilog=EPILOG)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for target in REGISTER:
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(sub)
    return p


def _main(argv) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def main(argv=None) -> int:
    return options.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
