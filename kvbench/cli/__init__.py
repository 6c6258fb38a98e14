"""The `kvbench` command: one subcommand per module, put together here.

Each command group lives in a module of its own with a ``register(subparsers)`` function;
this module only puts them together, and gives each command's --help its examples
(:data:`EXAMPLES`, one entry per command: a test holds every command to having one). Errors take
the one path of kvbench.cli.options: one line, exit 2 (130 on Ctrl-C, 143 on SIGTERM);
``--debug`` anywhere shows the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import textwrap

from kvbench.cli import options

# Each command group's register function, imported when the parser is built (so that
# `python -m kvbench.cli.gates` finds its module not yet imported by this package).
REGISTER = ("kvbench.cli.run:register", "kvbench.cli.data:register_gen_prefix",
            "kvbench.bench.compare:add_compare_parser", "kvbench.cli.gates:register",
            "kvbench.cli.data:register_list", "kvbench.cli.eviction:register",
            "kvbench.cli.faults:register", "kvbench.cli.sweep:register",
            "kvbench.cli.shrink:register", "kvbench.cli.fuzz:register",
            "kvbench.cli.serve:register", "kvbench.cli.route:register")

# Each command's examples, shown at the end of its --help.
EXAMPLES = {
    "run": ["kvbench run                              # every committed and boundary workload, every backend",
            "kvbench run workloads/fork-beam.jsonl --backend numpy --output -"],
    "check": ["kvbench check workloads/prefix-reuse.jsonl --backend numpy",
              "kvbench check mooncake_trace.jsonl --format mooncake --block-size 16 --keep-going"],
    "serve": ["kvbench serve --scenario opt13b --max-requests 50",
              "kvbench serve --trace azure_conv.csv --format azure --max-requests 200"],
    "gen": ["kvbench gen                              # rewrite workloads/ byte for byte",
            "kvbench gen --family prefix_sharing --seed 3 --out prefix-3.jsonl"],
    "prefix": ["kvbench prefix mooncake_trace.jsonl --sizes 64,256,1024 --out results/prefix",
               "kvbench prefix mooncake_trace.jsonl --backend vllm-blockpool --keep-going"],
    "compare": ["kvbench compare results/runs/run-A.json results/runs/run-B.json --no-charts",
                "kvbench compare sweep:prefix-cache@abc123 sweep:prefix-cache --metric hit_rate"],
    "gates": ["kvbench gates                            # exact figures (CI runs these) and speed ratios",
              "kvbench gates --skip-ratios --case fork-beam"],
    "list": ["kvbench list"],
    "list-models": ["kvbench list-models --budget 12GiB --models llama-3-8b,opt-13b"],
    "eviction": ["kvbench eviction workloads/tenant-fractional.jsonl --out results/eviction"],
    "faults": ["kvbench faults --quiet",
               "kvbench faults workloads/fork-beam.jsonl --markdown faults.md"],
    "sweep": ["kvbench sweep results/sweeps/prefix-cache/grid.toml --dry-run",
              "kvbench sweep results/sweeps/prefix-cache/grid.toml --workers 2"],
    "results": ["kvbench results                          # the sweeps in the store",
                "kvbench results prefix-cache --rows backend --cols budget --metric hit_rate"],
    "shrink": ["kvbench shrink failing.jsonl --backend my_pkg.cache:MyCache --max-seconds 60",
               "kvbench shrink failing.jsonl --backend numpy --emit pytest"],
    "route": ["kvbench route workloads/prefix-reuse.jsonl --replicas 4 --router longest-prefix",
              "kvbench route mooncake_trace.jsonl --format mooncake --replicas 1,2,4,8,16 --router dynamo"],
    "fuzz": ["kvbench fuzz --backend numpy --minutes 2",
             "kvbench fuzz --backend my_pkg.cache:MyCache --seed 7 --first --out fuzz-out"],
}

EXIT_STATUS = ("exit status: 0 every check passed, 1 a check FAILed, 2 an error (bad input, a "
               "backend that cannot run, nothing checked or passed), 130 interrupted, 143 "
               "terminated. --debug (anywhere on the line) shows the traceback of an error.")


class HelpFormatter(argparse.HelpFormatter):
    """argparse's, but an epilog of examples keeps its lines (descriptions are still wrapped)."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def examples(lines, after: str = "") -> str:
    text = "examples:\n" + "".join(f"  {line}\n" for line in lines)
    return text + ("\n" + textwrap.fill(after, 80) if after else "")


def parser() -> options.Parser:
    p = options.Parser(prog="kvbench", formatter_class=HelpFormatter)
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for target in REGISTER:
        module, _, function = target.partition(":")
        getattr(importlib.import_module(module), function)(sub)
    for name, command in sub.choices.items():
        command.formatter_class = HelpFormatter
        command.epilog = examples(EXAMPLES.get(name, ()))
    names = list(sub.choices)
    p.description = (f"kvbench checks KV-cache backends against an exact oracle and measures them; "
                     f"its commands are {', '.join(names[:-1])} and {names[-1]}.")
    p.epilog = examples(["kvbench run", "kvbench check workloads/fork-beam.jsonl --backend numpy",
                         "kvbench COMMAND --help"], after=EXIT_STATUS)
    return p


def _main(argv) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


def main(argv=None) -> int:
    return options.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
