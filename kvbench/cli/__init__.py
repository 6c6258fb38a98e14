"""The `kvbench` command: run, check, gen, prefix, compare, gates, list, eviction.

Each command group lives in a module of its own with a ``register(subparsers)`` function;
this module only puts them together and turns the errors a user can cause into one line.
"""
from __future__ import annotations

import argparse
import sys

from kvbench.bench.compare import add_compare_parser
from kvbench.cli import data, eviction, gates, run
from kvbench.traces.format import TraceError

REGISTER = (run.register, data.register_gen_prefix, add_compare_parser, gates.register,
            data.register_list, eviction.register)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvbench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for register in REGISTER:
        register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (TraceError, ValueError, KeyError, OSError) as e:
        print(f"kvbench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
