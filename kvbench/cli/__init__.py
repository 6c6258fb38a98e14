"""The `kvbench` command: run, check, gen, prefix, compare, gates, list, eviction, faults, shrink.

Each command group lives in a module of its own with a ``register(subparsers)`` function;
this module only puts them together. Errors take the one path of kvbench.cli.options: one line,
exit 2 (130 on Ctrl-C); ``--debug`` anywhere shows the traceback.
"""
from __future__ import annotations

import sys

from kvbench.bench.compare import add_compare_parser
from kvbench.cli import data, eviction, faults, gates, options, run, shrink

REGISTER = (run.register, data.register_gen_prefix, add_compare_parser, gates.register,
            data.register_list, eviction.register, faults.register, shrink.register)

EPILOG = ("exit status: 0 every check passed, 1 a check FAILed, 2 an error (bad input, a backend "
          "that cannot run, nothing checked or passed), 130 interrupted. --debug (anywhere on the "
          "line) shows the traceback of an error.")


def parser() -> options.Parser:
    p = options.Parser(prog="kvbench", description=__doc__.splitlines()[0], epilog=EPILOG)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in REGISTER:
        register(sub)
    return p


def _main(argv) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def main(argv=None) -> int:
    return options.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
