"""`kvbench shrink TRACE --backend B`: a failing trace cut down to a small one that fails the same
way, written beside it as NAME.min.jsonl (and, with --emit pytest, as a pytest case).

Exit status: 1 when the backend fails (a shrunk trace was written), 0 when it passes (nothing to
shrink), 2 when the trace cannot be judged (not applicable, an error of the harness) or the input
is bad.
"""
from __future__ import annotations

import sys
from pathlib import Path

from kvbench.analyses import suite
from kvbench.cli import options
from kvbench.cli.run import add_cache_args, settings
from kvbench.outputs import check_writable, write_text
from kvbench.progress import Progress
from kvbench.search.shrink import DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_SECONDS, shrink
from kvbench.traces.loaders import load_trace


class _Report:
    """The shrink's progress callback, shown by the one reporter (kvbench.progress)."""

    def __init__(self, quiet: bool):
        self.progress = Progress(None, "shrink", "replays", enabled=not quiet)

    def __call__(self, p) -> None:
        self.progress.note(f"{p.ops} ops left of {p.original_ops}, {p.phase}")
        self.progress.set(p.attempts)

    def close(self) -> None:
        self.progress.close()


def default_output(trace_path: str) -> Path:
    p = Path(trace_path)
    return p.with_name(p.stem + ".min.jsonl")


def cmd_shrink(args) -> int:
    trace = load_trace(args.trace, args.format, block_size=args.block_size)
    entry = options.runnable_backend(args.backend)
    out = Path(args.out) if args.out else default_output(args.trace)
    check_writable(out, option="--out")
    for policy in suite.policies_for(trace, args.policy):
        config = settings(args).config(trace, policy)
        label = args.backend + (f" policy={policy}" if policy else "")
        report = _Report(args.quiet)
        try:
            result = shrink(trace, entry.create, config, gather=args.gather,
                            max_seconds=args.max_seconds, max_attempts=args.max_attempts,
                            progress=report, backend=args.backend, source=args.trace)
        finally:
            report.close()
        if result.status == "passes":
            print(f"pass {label}")
            continue
        if not result.ok:
            print(f"kvbench shrink: refused ({label}): {result.status}: {result.reason}", file=sys.stderr)
            return 2
        write_text(out, result.trace.to_jsonl())
        c = result.shrunk_config
        print(f"FAIL {label}: {result.divergence}")
        print(result.summary() + ("" if result.stopped == "done" else
                                  " (the smallest found before it stopped)"))
        print(f"  {result.shrunk_divergence}")
        print(f"  settings: block_size {c.block_size}, num_blocks {c.num_blocks}"
              + (f", policy {c.policy}" if c.policy else ""))
        print(f"wrote {out}\nreproduce: kvbench check {out} --backend {args.backend}"
              + (f" --gather {args.gather}" if args.gather != "touched" else ""))
        if args.emit == "pytest":
            test = out.with_name("test_" + out.name.split(".")[0].replace("-", "_") + "_min.py")
            write_text(test, result.pytest_source(entry.create))
            print(f"wrote {test}")
        return 1
    print("passes: nothing to shrink")
    return 0


def register(sub) -> None:
    p = sub.add_parser("shrink", help="cut a failing trace down to a small one that fails the same way",
                       description=__doc__)
    p.add_argument("trace", help="the failing trace (JSONL or CSV; --format for a public request trace)")
    options.add_format_arg(p)
    p.add_argument("--backend", required=True, help="backend name or package.module:Factory")
    p.add_argument("--out", help="the shrunk trace (default: NAME.min.jsonl beside TRACE)")
    p.add_argument("--emit", choices=["pytest"],
                   help="also write the shrunk trace as a pytest case, test_NAME_min.py beside it")
    p.add_argument("--max-seconds", type=options.positive_float, default=DEFAULT_MAX_SECONDS,
                   help=f"stop after this long, keeping the smallest failing trace (default {DEFAULT_MAX_SECONDS:g})")
    p.add_argument("--max-attempts", type=options.positive_int, default=DEFAULT_MAX_ATTEMPTS,
                   help=f"stop after this many replays (default {DEFAULT_MAX_ATTEMPTS})")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_cache_args(p)
    p.set_defaults(func=cmd_shrink)
