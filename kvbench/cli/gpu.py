"""``python -m kvbench.cli.gpu``: the device check of the torch backend as a program (the checks
and benchmarks themselves are kvbench.bench.gpu's), through kvbench's one error path."""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from kvbench.analyses import suite
from kvbench.bench import gpu, records
from kvbench.cli.options import Parser, UsageError, run
from kvbench.contract import registry
from kvbench.outputs import check_writable

PROG = "python -m kvbench.cli.gpu"
# The torch backend's reading of a --device name (cuda, cuda:N, cpu), reached as a plug-in's is.
RESOLVE_DEVICE = "impls.torch_paged:resolve_device"


def main(argv=None) -> int:
    """``python -m kvbench.cli.gpu``, through kvbench's one error path (one line, exit 2)."""
    return run(_main, argv, prog=PROG)


def _main(argv) -> int:
    p = Parser(prog=PROG, description=gpu.__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="torch device: cuda (default), cuda:N or cpu")
    p.add_argument("--out", default=os.environ.get("OUT") or str(records.RESULTS_DIR / "runs"),
                   help="output directory (default $OUT, else results/runs)")
    p.add_argument("--size", choices=sorted(gpu.SIZES), default="full",
                   help="full (for a GPU) or tiny (the same code paths in seconds, anywhere)")
    p.add_argument("--traces", nargs="*", help="trace files to check (default: every committed workload)")
    p.add_argument("--skip-check", action="store_true", help="benchmarks only")
    p.add_argument("--skip-bench", action="store_true", help="checker only")
    args = p.parse_args(argv)

    ok, why = registry.resolve("torch").available()
    if not ok:
        raise UsageError(f"the torch backend cannot run here: {why}")
    import torch
    try:
        device = registry.load(RESOLVE_DEVICE)(torch, args.device)
    except ValueError as e:
        raise UsageError(f"--device {args.device}: {e}") from None
    out = check_writable(args.out, option="--out", folder=True)
    traces = [Path(t) for t in args.traces] if args.traces else suite.committed_workloads()
    suite.load_traces(traces)  # a bad trace is refused before any work
    size = gpu.SIZES[args.size]
    clock = gpu.Clock(torch, device)
    rows: list[dict] = []
    started = time.perf_counter()

    def stage(name, fn):
        t0 = time.perf_counter()
        got = fn()
        rows.extend(got)
        print(f"gpu_check: {name}: {len(got)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
        return got

    checks = []
    if not args.skip_check:
        checks = stage("checker", lambda: gpu.run_checks(traces, str(device), out))
    memory = stage("memory", lambda: gpu.memory_check(torch, device, size))
    if not args.skip_bench:
        stage("decode", lambda: gpu.bench_decode(torch, device, size, clock))
        stage("bandwidth", lambda: gpu.bench_bandwidth(torch, device, size, clock))

    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    params = {"device": str(device), "size": args.size, "model": dataclasses.asdict(size["model"]),
              "block_size": gpu.BLOCK, "gpu_name": gpu_name, "torch": torch.__version__,
              "cuda": torch.version.cuda if device.type == "cuda" else None,
              "torch_threads": torch.get_num_threads(),
              **{k: v for k, v in size.items() if k != "model"}}
    rec = records.record("gpu_check", rows, params, device=str(device))
    path = records.write(rec, out / f"gpu_check-{str(device).replace(':', '')}.json")

    failed = [r for r in checks if r["status"] in ("FAIL", "ERROR")]
    for r in failed:
        print(f"{r['status']} torch on {r['workload']} (policy {r['policy']}): "
              f"{r['divergence'] or r['error']}")
    for r in rows:
        if r["bench"] == "decode" and r["torch_vs_numpy"] is not None:
            print(f"decode batch {r['batch']:5d} {r['impl']:16s} {r['tokens_per_s']:12.0f} tokens/s "
                  f"torch/numpy {r['torch_vs_numpy']:.2f}")
        elif r["bench"] == "bandwidth":
            print(f"{r['what']:13s} {r['impl']:12s} {r['bytes_per_s'] / 1e9:8.2f} GB/s "
                  f"= {r['fraction_of_copy']:.2f} of {r['copy']}")
    mem_ok = all(r["ok"] for r in memory)
    print(f"memory: {'ok' if mem_ok else 'MISMATCH'} {memory[0]}")
    print(f"gpu_check: {len(checks)} checks, {len(failed)} failed; results in {path} "
          f"({time.perf_counter() - started:.0f} s)")
    return 0 if not failed and mem_ok else 1


if __name__ == "__main__":
    import sys
    sys.exit(main())
