"""The fixtures of the asv suite and of the exact and ratio gates (kvbench.bench.gates, .ratios):
asv_bench/benchmarks/common.py loads this file by path, so that every commit asv builds, those
from before it existed included, runs the same fixtures; the gates import it as a module.

APPEND ONLY, NEVER CHANGE. Every value here (seeds, shapes, lengths, the lists of backends and
workloads, what the replay driver does) is an input of stored results: change one and every
comparison across commits silently compares different things. Add a new fixture, a new backend
or a new workload at the end of its list instead, and give a benchmark that must change a new
name (or bump its ``version``).

This file must import with the kvbench of any commit asv builds, the oldest included: it uses
only the protocol, the registry and the trace format, through ``kvbench.api`` (the stable
surface), or their original module paths at commits from before ``kvbench.api`` existed (so it
imports no other module of its own package, and nothing relative). Anything a commit lacks makes
``setup`` raise NotImplementedError (asv shows n/a).

Over 500 lines: append only, and the replay without oracle that commits from before the driver
replay with is a copy that cannot move (it must run against those commits' kvbench).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

try:
    from kvbench.api import (
        Append,
        CacheConfig,
        Fork,
        Free,
        ModelSpec,
        OutOfMemory,
        Prefill,
        get_model,
        load,
        registry,
    )
    IMPORT_ERROR = ""
except ImportError:  # a commit from before kvbench.api (and the package's wings): the old paths
    try:
        from kvbench import registry
        from kvbench.formulas import ModelSpec, get_model
        from kvbench.protocol import CacheConfig, OutOfMemory
        from kvbench.trace import Append, Fork, Free, Prefill, load
        IMPORT_ERROR = ""
    except ImportError as e:  # a commit without the spine: every benchmark is n/a
        IMPORT_ERROR = f"kvbench at this commit lacks {e.name}: {e}"

try:  # the one value a prefill takes, at commits that have it (before: keywords)
    from kvbench.api import Prompt
except ImportError:
    Prompt = None

try:  # the harness's replay driver, at commits that have it (before: this file's own copy)
    from kvbench.api import replay as _driver_replay
    from kvbench.api import replay_figures as _driver_figures
except ImportError:
    _driver_replay = _driver_figures = None


def prompt_call(tokens, **fields) -> tuple:
    """What a prefill of ``tokens`` tokens with these Prompt fields (tenant, final_tokens,
    block_hashes, prompt_tokens) passes at this commit: (its second argument, its keywords).
    A timed call builds it in setup."""
    if Prompt is None:
        return tokens, fields
    return Prompt(tokens, **fields), {}


def prefill(backend, seq, tokens, kv=None, *, step=0, protect=(), **fields):
    """``backend.prefill`` of ``tokens`` tokens with these Prompt fields."""
    prompt, keywords = prompt_call(tokens, **fields)
    return backend.prefill(seq, prompt, kv, step=step, protect=protect, **keywords)


REPO_ROOT = Path(__file__).resolve().parents[2]
# The working tree's committed traces: the same bytes for every commit asv builds.
WORKLOADS_DIR = REPO_ROOT / "workloads"

SEED = 20240611
BLOCK_SIZE = 16
# 2 layers x 2 KV heads x 64 dims x fp16: 1 KiB per token (1024 = 2 * 2 * 2 * 64 * 2), so the
# data-moving calls (prefill, decode, gather) move enough bytes to be measured, and a decode
# batch of 256 fits a small pool.
MODEL_SHAPE = dict(name="asv-1k", layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)

# Benchmark name -> (registry name or package.module:Factory, CacheConfig fields it fixes).
# Listed here, not read from the registry: asv imports this file against every commit it builds,
# and a benchmark's parameters are the keys of its history, so they must not follow one commit's
# registry (older commits have other entries, or none).
BACKENDS = {
    "numpy": ("numpy", {}),
    "torch-cpu": ("torch", {"device": "cpu"}),
    "torch-cuda": ("torch", {"device": "cuda"}),
    "object": ("impls.object_model:ObjectModel", {}),
    "contiguous-max": ("contiguous-max", {}),
    "contiguous-pow2": ("contiguous-pow2", {}),
    "contiguous-oracle": ("contiguous-oracle", {}),
    "numpy-eagle": ("numpy-eagle", {}),
}
PAGED = ["numpy", "torch-cpu", "torch-cuda", "object"]  # the time_ grids
REPLAYED = ["numpy", "torch-cpu", "torch-cuda", "object",
            "contiguous-max", "contiguous-pow2", "contiguous-oracle",
            "numpy-eagle", "numpy-compressed"]

# Committed workloads (workloads/<name>.jsonl); a tenant mix runs under each eviction policy.
WORKLOADS = ["decode-stream", "fork-beam", "fork-parallel", "prefill-alpaca", "prefill-sharegpt",
             "tenant-flood", "tenant-fractional", "tenant-late",
             "prefix-reuse", "prefix-tenants",
             "hybrid-windows",
             "edge-refusals", "edge-eviction", "fork-wide", "long-history",
             "prefix-salts", "edge-decode", "hybrid-decode",
             "lifecycle-chunked", "lifecycle-speculative", "lifecycle-preempt",
             "tier-turns",
             "variant-chunked", "variant-sinks", "variant-mla", "variant-mamba",
             "tier-agentic", "hybrid-cut-hits", "lifecycle-swap", "tier-races"]
TENANT_MIXES = ["tenant-flood", "tenant-fractional", "tenant-late",
                "prefix-tenants",
                "edge-eviction", "edge-decode"]
POLICIES = ["lru", "lfu", "fair"]
REPLAY_CASES = [w if w not in TENANT_MIXES else f"{w}@{p}"
                for w in WORKLOADS for p in (POLICIES if w in TENANT_MIXES else [None])]

DECODE_BATCHES = [1, 16, 256]
PREFILL_TOKENS = [128, 4096]
GATHER_TOKENS = [128, 4096]
LONG_SEQUENCE = 1024  # fork and free: a sequence of 64 full blocks (1024 = 64 * 16)


def uncovered_workloads() -> list[str]:
    """Committed workloads the suite has no case for (the suite guards this at import)."""
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl") if p.stem not in WORKLOADS)


_missing = uncovered_workloads()
if _missing:
    raise RuntimeError(f"workloads {_missing} are committed but have no benchmark: append them to "
                       f"WORKLOADS (and TENANT_MIXES for a tenant mix) in {__file__}")


def skip_unless(condition: bool, reason: str) -> None:
    if not condition:
        raise NotImplementedError(reason)


def close(bench) -> None:
    """teardown: close the backend a setup made, if it made one (setup may have raised)."""
    backend = bench.__dict__.pop("backend", None)
    if backend is not None:
        backend.close()


def sync(backend) -> None:
    """Wait for a CUDA backend's queued work, so that a timing covers it."""
    if getattr(backend.config, "device", "cpu").startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def model():
    skip_unless(not IMPORT_ERROR, IMPORT_ERROR)
    return ModelSpec(**MODEL_SHAPE)


def make_backend(name: str, *, model_spec=None, num_blocks: int = 1024, store_kv: bool = True,
                 **config):
    """A fresh backend, or NotImplementedError saying why it cannot run here."""
    skip_unless(not IMPORT_ERROR, IMPORT_ERROR)
    target, fixed = BACKENDS[name]
    settings = {**config, **fixed}
    if settings.get("device", "cpu") == "cuda":
        try:
            import torch
        except ImportError:
            raise NotImplementedError("torch is not installed") from None
        skip_unless(torch.cuda.is_available(), "no CUDA device")
    try:
        entry = registry.resolve(target)
    except ValueError as e:  # a backend this commit's registry does not know yet
        raise NotImplementedError(str(e)) from None
    ok, why = entry.available()
    skip_unless(ok, f"{name}: {why}")
    cfg = CacheConfig(model=model_spec or model(), block_size=settings.pop("block_size", BLOCK_SIZE),
                      num_blocks=num_blocks, store_kv=store_kv, **settings)
    backend = entry.create(cfg)
    if store_kv and not backend.capabilities.holds_kv:
        backend.close()
        raise NotImplementedError(f"{name} holds no K/V (ledger only)")
    return backend


def prompt_lengths(n: int, seed: int = SEED) -> np.ndarray:
    """n prompt lengths in [1, 128]: at most 8 blocks each."""
    return np.random.default_rng(seed).integers(1, 129, size=n)


def zeros_kv(tokens: int, spec=None) -> np.ndarray:
    spec = spec or model()
    return np.zeros((tokens, 2, spec.layers, spec.kv_heads, spec.head_dim), dtype=np.float16)


def decode_batch(name: str, batch: int, store_kv: bool = True):
    """A backend holding ``batch`` sequences (ids 0..batch-1) with prompt_lengths(batch) tokens.

    The pool has room for every prompt plus one new block per sequence (at most 8 + 1 blocks
    each: 16 decode steps of one token take at most one new block).
    """
    backend = make_backend(name, num_blocks=batch * 9, store_kv=store_kv)
    return fill_decode_batch(backend, batch, store_kv), list(range(batch))


def fill_decode_batch(backend, batch: int, store_kv: bool = True):
    lengths = prompt_lengths(batch)
    buf = zeros_kv(int(lengths.max())) if store_kv else None
    for seq, n in enumerate(lengths.tolist()):
        prefill(backend, seq, n, None if buf is None else buf[:n], final_tokens=n + 64)
    return backend


def interleaved_pair(name: str, tokens: int):
    """A backend holding sequences 0 and 1 of ``tokens`` tokens each, their blocks interleaved
    (each grew by one block in turn), so that a gather reads scattered blocks."""
    backend = make_backend(name, num_blocks=2 * -(-tokens // BLOCK_SIZE))
    return fill_interleaved_pair(backend, tokens)


def fill_interleaved_pair(backend, tokens: int):
    chunk = zeros_kv(BLOCK_SIZE)
    prefill(backend, 0, BLOCK_SIZE, chunk, final_tokens=tokens)
    prefill(backend, 1, BLOCK_SIZE, chunk, final_tokens=tokens)
    for b in range(1, -(-tokens // BLOCK_SIZE)):
        backend.append([0], [BLOCK_SIZE], chunk, step=b)
        backend.append([1], [BLOCK_SIZE], chunk, step=b)
    return backend


# --- workloads and the replay without oracle ---------------------------------------------------

_traces: dict = {}


def load_workload(name: str):
    skip_unless(not IMPORT_ERROR, IMPORT_ERROR)
    if name not in _traces:
        path = WORKLOADS_DIR / f"{name}.jsonl"
        skip_unless(path.exists(), f"{path} is not in this checkout")
        try:
            _traces[name] = load(str(path))
        except ValueError as e:  # a trace operation this commit's kvbench does not know
            raise NotImplementedError(f"kvbench at this commit cannot read {name}: {e}") from None
    return _traces[name]


def split_case(case: str):
    workload, _, policy = case.partition("@")
    return workload, policy or None


def replay_config(trace, policy=None, store_kv: bool = False, device: str = "cpu"):
    """The settings `kvbench run` uses for a trace: its header's, else tiny model, B=16, 256 blocks;
    the contiguous `max` reservation is the next power of two of the longest sequence."""
    s = trace.header.settings
    longest = max(trace.final_lengths().values(), default=1)
    # Only traces that ask for prefix caching pass the field (commits before it lack it: n/a).
    caching = {"prefix_caching": True} if s.get("prefix_caching") else {}
    try:
        return CacheConfig(model=get_model(s.get("model", "tiny")), block_size=int(s.get("block_size", 16)),
                           num_blocks=int(s.get("num_blocks", 256)), store_kv=store_kv, device=device,
                           max_context=int(s.get("max_context") or 1 << (longest - 1).bit_length()),
                           policy=policy, tenant_weights=dict(trace.header.tenants), **caching)
    except TypeError as e:
        raise NotImplementedError(f"kvbench at this commit cannot configure this trace: {e}") from None


def replay_backend(name: str, case: str, store_kv: bool = False):
    """(backend configured for the case's workload, trace, policy)."""
    workload, policy = split_case(case)
    trace = load_workload(workload)
    if getattr(trace.header, "tiers", ()):  # stores and loads: only the checker drives them
        raise NotImplementedError(f"the replay without oracle does not drive {workload}'s tiers")
    cfg = replay_config(trace, policy, store_kv)
    backend = make_backend(name, model_spec=cfg.model, **{
        f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "model"})
    if policy and policy not in backend.capabilities.eviction:
        backend.close()
        raise NotImplementedError(f"{name} does not implement eviction policy {policy}")
    return backend, trace


def kv_buffer(trace, config):
    """Zeros for the largest single call of the trace (a prefill, a recompute or a batch)."""
    if not config.store_kv:
        return None
    calls = [max(trace.final_lengths().values(), default=0)]
    calls += [sum(op.tokens) for op in trace.ops if isinstance(op, Append)]
    m = config.model
    # A token's K/V as the model lays it out (an MLA latent is one part, not K and V); commits
    # from before ModelSpec.kv_shape had K and V only.
    shape = getattr(m, "kv_shape", None) or (2, m.layers, m.kv_heads, m.head_dim)
    return np.zeros((max(calls),) + tuple(shape), dtype=config.kv_dtype)


def replay(backend, trace, kv=None, after_op=None) -> dict:
    """Drive ``backend`` through ``trace`` by the harness's replay rules, with no oracle beside
    it: kvbench's own driver (``kvbench.api.replay``) where the commit has one, else the copy
    below, which commits from before the driver replay with (the tests hold the two equal)."""
    if _driver_replay is not None:
        return _driver_replay(backend, trace, kv, after_op)
    return replay_before_driver(backend, trace, kv, after_op)


def replay_before_driver(backend, trace, kv=None, after_op=None) -> dict:
    """Drive ``backend`` through ``trace`` as the checker does, with no oracle beside it.

    A sequence the backend evicted is recomputed (re-prefilled to its current length) in the step
    that touches it, before the operation; an operation that runs out of memory is dropped, and a
    refused prefill or fork drops every later operation on its sequence. ``kv``: a zeros buffer
    (kv_buffer) sliced for each call, or None for a ledger-only backend. ``after_op(op)`` is
    called after every operation. Returns counts: evictions, recomputed_tokens, ooms.
    """
    final = trace.final_lengths()
    length, tenant, hashes = {}, {}, {}
    evicted, refused = set(), set()
    drafted = {}  # sequence -> draft tokens of its last append (SPEC §13)
    counts = {"evictions": 0, "recomputed_tokens": 0, "ooms": 0}

    def data(n):
        return None if kv is None else kv[:n]

    def took(victims):
        victims = tuple(victims or ())
        counts["evictions"] += len(victims)
        evicted.update(victims)

    def restore(seq, step, protect) -> bool:
        try:
            victims = prefill(backend, seq, length[seq], data(length[seq]), tenant=tenant[seq],
                              final_tokens=final[seq], step=step, protect=tuple(protect),
                              block_hashes=hashes.get(seq))
        except OutOfMemory:
            counts["ooms"] += 1
            return False
        evicted.discard(seq)
        took(victims)
        counts["recomputed_tokens"] += length[seq]
        return True

    for op in trace.ops:
        if isinstance(op, Prefill):
            chunked = getattr(op, "prompt_tokens", None)
            try:
                took(prefill(backend, op.seq, op.tokens, data(op.tokens), tenant=op.tenant,
                             final_tokens=final[op.seq], step=op.step,
                             block_hashes=op.block_hashes,
                             **({"prompt_tokens": chunked} if chunked else {})))
                length[op.seq], tenant[op.seq] = op.tokens, op.tenant
                if op.block_hashes:  # a recompute hits the prompt's cached blocks, as the checker's
                    hashes[op.seq] = op.block_hashes
            except OutOfMemory:
                counts["ooms"] += 1
                refused.add(op.seq)
        elif isinstance(op, Append):
            pairs = [(s, t) for s, t in zip(op.seqs, op.tokens) if s not in refused]
            seqs = [s for s, _ in pairs]
            if seqs and all(restore(s, op.step, seqs) for s in seqs if s in evicted):
                toks = [t for _, t in pairs]
                try:
                    took(backend.append(seqs, toks, data(sum(toks)), step=op.step))
                    for s, t in pairs:
                        length[s] += t
                    drafted.update((s, d) for s, d in zip(op.seqs, getattr(op, "draft", None) or ())
                                   if d and s in seqs)
                except OutOfMemory:
                    counts["ooms"] += 1
        elif isinstance(op, Fork):
            lost = op.src in refused or (op.src in evicted
                                         and not restore(op.src, op.step, (op.src, op.seq)))
            if lost:
                refused.add(op.seq)
            else:
                try:
                    took(backend.fork(op.seq, op.src, final_tokens=final[op.seq], step=op.step))
                    length[op.seq], tenant[op.seq] = length[op.src], tenant[op.src]
                except OutOfMemory:
                    counts["ooms"] += 1
                    refused.add(op.seq)
        elif isinstance(op, Free):
            if op.seq in evicted:
                evicted.discard(op.seq)  # the backend dropped it when it evicted it
            elif op.seq not in refused:
                backend.free(op.seq, step=op.step)
            length.pop(op.seq, None)
        elif op.kind == "accept" and op.seq in drafted:
            k = drafted.pop(op.seq)
            if op.seq not in evicted or restore(op.seq, op.step, (op.seq,)):
                took(backend.accept(op.seq, op.n, drafted=k, step=op.step))
                length[op.seq] -= k - op.n
        elif op.kind == "preempt" and op.seq not in refused and op.seq not in evicted:
            backend.free(op.seq, step=op.step)  # recompute: its resume prefills it again
            evicted.add(op.seq)
        elif op.kind == "resume" and op.seq in evicted:
            restore(op.seq, op.step, (op.seq,))
        if after_op is not None:
            after_op(op)
    return counts


def ledger_stats(backend, trace, kv=None) -> dict:
    """Replay and read the backend's own ledger after every operation: lower-is-better figures
    (``kvbench.api.replay_figures`` where the commit has it, else the copy below)."""
    if _driver_figures is not None:
        return _driver_figures(backend, trace, kv)
    return ledger_stats_before_driver(backend, trace, kv)


def ledger_stats_before_driver(backend, trace, kv=None) -> dict:
    """Replay and read the backend's own ledger after every operation: lower-is-better figures.

    Wasted slots are internal plus external fragmentation (slots that will never hold a token;
    reservation, the slots later tokens of the same sequence will fill, is not waste). Means are
    over operations, summed with math.fsum so that they do not depend on summation order.
    ``peak_blocks`` is None for a layout without blocks.
    """
    from math import fsum
    rows = []

    def sample(op):
        led = backend.ledger()
        rows.append((led.blocks_used, led.bytes_in_use, led.fragmentation,
                     led.internal_fragmentation + led.external_fragmentation))

    counts = replay_before_driver(backend, trace, kv, sample)
    n = len(rows) or 1
    blocks = [r[0] for r in rows if r[0] is not None]
    return {
        "peak_blocks": max(blocks) if blocks else None,
        "peak_bytes": max((r[1] for r in rows), default=0),
        "final_fragmentation": rows[-1][2] if rows else 0.0,
        "mean_fragmentation": fsum(r[2] for r in rows) / n,
        "peak_wasted_slots": max((r[3] for r in rows), default=0),
        "mean_wasted_slots": fsum(r[3] for r in rows) / n,
        **counts,
    }


def case_stats(name: str, case: str) -> dict:
    """ledger_stats of a backend (ledger only) on a replay case; NotImplementedError if n/a."""
    backend, trace = replay_backend(name, case, store_kv=False)
    try:
        return ledger_stats(backend, trace)
    finally:
        backend.close()


# --- quantization --------------------------------------------------------------------------------

# Quantizer name -> module (duck-typed protocol of kvbench.quant: quantize, dequantize).
QUANTIZERS = ["reference", "numpy", "torch-cpu", "torch-cuda"]
_QUANT_MODULES = {"reference": ("kvbench.quant", None), "numpy": ("impls.quant_numpy", None),
                  "torch-cpu": ("impls.quant_torch", "cpu"), "torch-cuda": ("impls.quant_torch", "cuda")}
QUANT_SCHEMES = {
    "int8-sym-channel": dict(bits=8, symmetric=True, granularity="channel"),
    "int8-asym-token": dict(bits=8, symmetric=False, granularity="token"),
    "int4-asym-group32": dict(bits=4, symmetric=False, granularity="group", group_size=32),
    "int2-asym-channel": dict(bits=2, symmetric=False, granularity="channel"),
}
KV_FORMATS = ["fp16", "fp8-e4m3", "int8-token-sym", "int8-kivi", "int4-group32", "int4-kivi",
              "int2-kivi"]
QUANT_SAMPLE_TOKENS = 4096


def _quant():
    skip_unless(not IMPORT_ERROR, IMPORT_ERROR)
    try:
        from kvbench import quant
    except ImportError as e:
        raise NotImplementedError(f"kvbench at this commit has no quantization: {e}") from None
    return quant


class _OnDevice:
    """A torch quantizer fed and read on ``device``: NumPy in, its own tensors between calls."""

    def __init__(self, module, device):
        self.module, self.device = module, device

    def quantize(self, x, scheme):
        import torch
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x)).to(self.device)
        out = self.module.quantize(t, scheme)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return out

    def dequantize(self, qt):
        import torch
        out = self.module.dequantize(qt)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return out


class _Steps:
    """impls.quant_numpy by its NumPy steps, even where the compiled kernels are installed."""

    def __init__(self, module):
        self.module = module

    def quantize(self, x, scheme):
        return self.module.quantize(x, scheme, compiled=False)

    def dequantize(self, qt):
        return self.module.dequantize(qt)


def quantizer(name: str):
    """The quantizer module (or a device wrapper), or NotImplementedError saying why not."""
    import importlib
    _quant()
    if name == "numpy-steps":
        return _Steps(quantizer("numpy"))
    module_name, device = _QUANT_MODULES[name]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise NotImplementedError(f"{module_name} cannot be imported here: {e}") from None
    ok, why = module.available() if hasattr(module, "available") else (True, "")
    skip_unless(ok, f"{name}: {why}")
    if device is None:
        return module
    try:
        import torch
    except ImportError:
        raise NotImplementedError("torch is not installed") from None
    skip_unless(device != "cuda" or torch.cuda.is_available(), "no CUDA device")
    return _OnDevice(module, device)


def quant_scheme(name: str):
    return _quant().QuantScheme(**QUANT_SCHEMES[name])


_samples: dict = {}


def kv_sample(tokens: int = QUANT_SAMPLE_TOKENS, seed: int = SEED) -> np.ndarray:
    """K/V-like float16 values ``[tokens, 2, 2, 2, 64]`` (4 MiB at 4096 tokens): normal, each
    channel scaled by a lognormal factor (a few channels 5-10x the rest, as keys have)."""
    if (tokens, seed) not in _samples:
        rng = np.random.default_rng(seed)
        spec = model()
        shape = (tokens, 2, spec.layers, spec.kv_heads, spec.head_dim)
        channel_scale = rng.lognormal(0.0, 1.0, size=shape[1:])
        _samples[tokens, seed] = (rng.standard_normal(shape) * channel_scale).astype(np.float16)
    return _samples[tokens, seed]


def quant_stats(impl, x, scheme) -> dict:
    """Error statistics of ``impl`` on ``x``, computed by the reference kvbench.quant."""
    Q = _quant()
    qt = impl.quantize(x, scheme)
    x_hat = impl.dequantize(qt)
    return Q.error_stats(x, Q.to_numpy(x_hat)[0], qt).as_dict()


def format_bytes_per_token(fmt_name: str) -> float:
    Q = _quant()
    formats = {f.name: f for f in Q.kv_formats(group_size=32)}
    skip_unless(fmt_name in formats, f"kvbench.quant has no KV format {fmt_name!r} here")
    block, _ = Q.format_block_bytes(formats[fmt_name], model(), BLOCK_SIZE)
    return block / BLOCK_SIZE


# --- quantized pools -------------------------------------------------------------------------------

BACKENDS["numpy-int8"] = ("numpy-int8", {})
BACKENDS["numpy-int4"] = ("numpy-int4", {})
BACKENDS["numpy-int4-steps"] = ("numpy-int4-steps", {})
for _name in ("numpy-fp8", "numpy-fp8-token-head", "numpy-nvfp4"):  # SPEC §12's float formats
    BACKENDS[_name] = (_name, {})
POOLS = ["numpy", "torch-cpu", "object", "numpy-int8", "numpy-int4", "numpy-int4-steps", "numpy-fp8",
         "numpy-fp8-token-head", "numpy-nvfp4"]


def pool_bytes_per_token(name: str) -> float:
    """Bytes per token slot of a paged pool, from the backend's own ledger: one full block of
    the asv-1k model (1024 B/token in fp16) divided by its BLOCK_SIZE slots."""
    backend = make_backend(name, num_blocks=1, store_kv=False)
    try:
        prefill(backend, 0, BLOCK_SIZE, None, final_tokens=BLOCK_SIZE)
        return backend.ledger().bytes_in_use / BLOCK_SIZE
    finally:
        backend.close()


# --- scale: traces as columns, the incremental checker ------------------------------

SCALE_DECODE_REQUESTS = [200, 2000]  # decode traces of ~1,150 and ~8,000 operations
SCALE_GATHER_TOKENS = 4096  # a long sequence, of which one block is read back


def decode_trace(requests: int):
    """Continuous batching of up to 32 sequences with Alpaca lengths (seed 0), as a trace whose
    header suggests a budget with room for its peak (no eviction)."""
    skip_unless(not IMPORT_ERROR, IMPORT_ERROR)
    try:
        from kvbench.traces import generators
        from kvbench.traces.builder import peak_blocks
    except ImportError as e:
        raise NotImplementedError(f"kvbench at this commit lacks {e.name}") from None
    t = generators.decode_streams(0, num_requests=requests, max_batch=32, arrival_rate=2, law="alpaca")
    t.header.settings = {"block_size": BLOCK_SIZE, "num_blocks": peak_blocks(t.ops, BLOCK_SIZE) + 64}
    return t
