"""Backends by name: the built-ins, those other packages register, and ``module:Factory`` ad hoc.

Another package registers a backend through the entry-point group ``kvbench.backends``::

    [project.entry-points."kvbench.backends"]
    my-pool = "my_pkg.pool:MyPool"

A factory is a :class:`~kvbench.contract.protocol.Backend` subclass (or any callable taking a
``CacheConfig`` and returning a Backend). Classes are imported only when used, so a backend whose
dependencies are missing is still listed, with the reason it cannot run.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from kvbench.contract.protocol import Backend, CacheConfig, Refusal

ENTRY_POINT_GROUP = "kvbench.backends"


def load(target: str, what: str = "target"):
    """The object a ``package.module:attr`` string names, its module imported now: how kvbench
    reaches code of impls/ (backends, the fault catalogue, kernels) and of plug-ins without
    importing it by name, so that none of kvbench's modules depends on a backend's."""
    module, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"{what} {target!r} must look like 'package.module:Factory'")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


class BackendUnavailable(NotImplementedError):
    """A backend that cannot be made here: its import fails, ``available()`` says no, its factory
    does not take a CacheConfig or returns something else than a Backend, or it refuses the
    settings (raises ValueError or NotImplementedError). The message is one line: the reason.
    (A NotImplementedError, so that the asv suite and the gates report such a case n/a, as they
    do a backend a commit lacks.) Anything else a factory raises is no refusal but its crash,
    raised as it is: the checker's caller makes it the backend's FAIL."""


# What a backend is, for the lists that pick backends (the default run, the gates, the tests):
TAGS = {
    "default": "replayed by `kvbench run` with no --backend",
    "paged": "a block pool (SPEC §2)",
    "contiguous": "one slab per sequence (SPEC §3)",
    "quantized": "stores quantized K/V (SPEC §4)",
    "engine": "a real serving engine's own classes (an opt-in environment)",
    "speed-reference": "the per-object model that speed ratios are taken against",
    "gated": "its exact figures are CI's regression gates (results/gates/expected.json)",
}


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: str  # "package.module:Factory"
    origin: str = "built-in"
    overrides: dict = field(default_factory=dict)  # CacheConfig fields this entry fixes
    tags: frozenset = frozenset()  # of TAGS
    asv_name: str = ""  # its name in the asv suite, where that differs (kept for asv's history)
    # The committed workloads the default run replays it on (empty: all of them): a variant
    # there for one code path, not worth the whole suite's time.
    default_workloads: tuple = ()

    def __post_init__(self):
        unknown = set(self.tags) - set(TAGS)
        if unknown:
            raise ValueError(f"backend {self.name}: unknown tags {sorted(unknown)} (known: {', '.join(TAGS)})")

    def load(self):
        return load(self.target, what="backend target")

    def available(self) -> tuple[bool, str]:
        try:
            factory = self.load()
        except Exception as e:  # an optional dependency that is missing, a typo in a plug-in
            return False, f"cannot import {self.target}: {type(e).__name__}: {e}"
        check = getattr(factory, "available", None)
        return check() if callable(check) else (True, "")

    def create(self, config: CacheConfig) -> Backend:
        """A backend for ``config``, or BackendUnavailable saying in one line why not; the
        factory's own exception where it crashes (anything but ValueError and
        NotImplementedError, its refusals of the settings)."""
        ok, why = self.available()
        if not ok:
            raise BackendUnavailable(why)
        factory = self.load()
        if not callable(factory):
            raise BackendUnavailable(f"{self.target} is a {type(factory).__name__}, not a backend "
                                     f"factory (a Backend subclass, or a callable taking a CacheConfig)")
        if self.overrides:
            config = dataclasses.replace(config, **self.overrides)
        try:
            inspect.signature(factory).bind(config)
        except TypeError:
            raise BackendUnavailable(
                f"{self.target}{inspect.signature(factory)}: a backend factory must take one "
                f"argument, a CacheConfig") from None
        except ValueError:  # a builtin without a signature: let the call tell
            pass
        try:
            backend = factory(config)
        except (ValueError, NotImplementedError) as e:
            if e.args and isinstance(e.args[0], Refusal):  # already an n/a's reason: named as this entry
                raise BackendUnavailable(str(dataclasses.replace(e.args[0], who=self.name))) from e
            raise BackendUnavailable(f"{self.name} cannot run with these settings: "
                                     f"{type(e).__name__}: {e}") from e
        if not isinstance(backend, Backend):
            raise BackendUnavailable(f"{self.target} made a {type(backend).__name__}, not a "
                                     f"kvbench Backend (subclass kvbench.protocol.Backend)")
        if backend.name == Backend.name:
            backend.name = self.name
        return backend


def _builtin(name, target, *tags, asv_name="", default_workloads=(), **overrides) -> BackendEntry:
    return BackendEntry(name, target, overrides=overrides, tags=frozenset(tags), asv_name=asv_name,
                        default_workloads=default_workloads)


# The default run's traces on a model of compressed groups (kvbench.traces.boundaries).
COMPRESSED_WORKLOADS = ("boundary-compressed-0", "boundary-compressed-1")

BUILTIN = [
    _builtin("numpy", "impls.numpy_paged:NumpyPaged", "default", "paged", "gated"),
    _builtin("torch", "impls.torch_paged:TorchPaged", "default", "paged", "gated", asv_name="torch-cpu"),
    # Both quantized pools: int4 packs two codes a byte and stores a zero point, int8 does neither.
    _builtin("numpy-int8", "impls.numpy_quant_paged:NumpyQuantPaged", "default", "paged",
             "quantized", kv_format="int8"),
    _builtin("numpy-int4", "impls.numpy_quant_paged:NumpyQuantPaged", "default", "paged",
             "quantized", kv_format="int4"),
    # int4 quantized by the NumPy steps, which the compiled kernels replace where numba is
    # installed: the steps' packing and zero points run by default too, on the workloads that
    # write (decode), copy on write (forks), read back hits and recompute (a fifth of the time).
    _builtin("numpy-int4-steps", "impls.numpy_quant_paged:NumpyQuantSteps", "default", "paged",
             "quantized", kv_format="int4",
             default_workloads=("decode-stream", "fork-beam", "prefix-reuse", "edge-eviction")),
    # SPEC §12's float formats, real codes and scales: fp8 e4m3 per tensor and per token-head,
    # NVFP4 (e2m1 codes, e4m3 scales per 16, a tensor scale). By default on the workloads that
    # write (decode), copy on write (forks), read back hits, tiers, windows, MLA's latent and
    # chunks, evict and recompute: each format a few of them (a sixth of the time for the three).
    _builtin("numpy-fp8", "impls.numpy_float_paged:NumpyFp8Tensor", "default", "paged", "quantized",
             kv_format="fp8-tensor",
             default_workloads=("decode-stream", "fork-beam", "prefix-reuse", "tier-turns", "variant-mla",
                                "boundary-encodings-0")),
    _builtin("numpy-fp8-token-head", "impls.numpy_float_paged:NumpyFp8TokenHead", "default", "paged",
             "quantized", kv_format="fp8-token-head",
             default_workloads=("decode-stream", "fork-beam", "prefix-reuse", "edge-eviction",
                                "boundary-encodings-1")),
    _builtin("numpy-nvfp4", "impls.numpy_float_paged:NumpyNvfp4", "default", "paged", "quantized",
             kv_format="nvfp4",
             default_workloads=("decode-stream", "fork-beam", "prefix-reuse", "hybrid-decode",
                                "variant-chunked", "tier-turns", "boundary-encodings-2")),
    *(_builtin(f"contiguous-{r}", "impls.contiguous:Contiguous", "default", "contiguous", "gated",
               reservation=r) for r in ("max", "pow2", "oracle")),
    # vLLM's speculative-decoding rules, declared: rejected drafts' blocks kept as lookahead
    # slots, an EAGLE hit's last block computed again; on the workloads where they differ.
    _builtin("numpy-eagle", "impls.numpy_lookahead:NumpyEagle", "default", "paged",
             default_workloads=("lifecycle-speculative", "lifecycle-chunked", "prefix-reuse",
                                "boundary-rollback-0", "boundary-chunks-0")),
    # SPEC §12's compressed(r) groups (DeepSeek-V4): NumpyPaged with a table position per B * r
    # tokens in such a group; on the workloads of compressed models only.
    _builtin("numpy-compressed", "impls.numpy_compressed:NumpyCompressed", "default", "paged",
             default_workloads=COMPRESSED_WORKLOADS),
    _builtin("vllm-blockpool", "impls.engines.vllm_blockpool:VllmBlockPool", "engine", "paged"),
    _builtin("vllm-kvmanager", "impls.engines.vllm_kvmanager:VllmKVManager", "engine", "paged"),
    _builtin("vllm-kvmanager-dense", "impls.engines.vllm_kvmanager:VllmKVManagerDense", "engine",
             "paged"),
    _builtin("vllm-offload", "impls.engines.vllm_offload:VllmOffload", "engine", "paged"),
    _builtin("lmcache-cpu", "impls.engines.lmcache_cpu:LMCacheCPU", "engine", "paged"),
    # SGLang's serving default (UnifiedRadixCache, lru), then its other policies and RadixCache.
    *(_builtin(name, f"impls.engines.sglang_radix:{cls}", "engine", "paged")
      for name, cls in (("sglang", "Sglang"), ("sglang-lfu", "SglangLFU"),
                        ("sglang-slru", "SglangSLRU"), ("sglang-priority", "SglangPriority"),
                        ("sglang-fifo", "SglangFIFO"), ("sglang-mru", "SglangMRU"))),
    _builtin("sglang-radix", "impls.engines.sglang_radix:SglangRadix", "engine", "paged"),
    _builtin("sglang-radix-lfu", "impls.engines.sglang_radix:SglangRadixLFU", "engine", "paged"),
    # The straightforward per-object model: a reference for speed ratios, ledger only.
    _builtin("python-objects", "impls.object_model:ObjectModel", "paged", "speed-reference", "gated",
             asv_name="object"),
]


def serving_departures(name: str) -> tuple | None:
    """How an engine backend departs from its engine's serving default (its factory's
    ``serving_departures()``, empty: the serving default); None for a backend that is no engine's."""
    try:
        entry = resolve(name)
    except ValueError:
        return None
    if "engine" not in entry.tags:
        return None
    try:
        factory = entry.load()
    except Exception:  # an engine adapter that cannot be imported says nothing
        return None
    departures = getattr(factory, "serving_departures", None)
    return tuple(departures()) if callable(departures) else ()


def tagged(*tags: str) -> tuple:
    """The registered backends that carry every one of ``tags``, in registry order."""
    unknown = set(tags) - set(TAGS)
    if unknown:
        raise ValueError(f"unknown tags {sorted(unknown)} (known: {', '.join(TAGS)})")
    return tuple(n for n, e in entries().items() if set(tags) <= e.tags)


# What `kvbench run` replays by default: one of each design, plus torch where it can run.
DEFAULT_BACKENDS = tuple(e.name for e in BUILTIN if "default" in e.tags)


def entries() -> dict[str, BackendEntry]:
    """Every known backend: built-ins first, then installed plug-ins."""
    found = {e.name: e for e in BUILTIN}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"plug-in {dist.name} {dist.version}" if dist is not None else "plug-in"
        found.setdefault(ep.name, BackendEntry(ep.name, ep.value, origin=origin))
    return found


def resolve(name: str) -> BackendEntry:
    """A registered name, or an ad hoc ``package.module:Factory``."""
    known = entries()
    if name in known:
        return known[name]
    if ":" in name:
        return BackendEntry(name, name, origin="ad hoc")
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(known)} "
                     f"(or give one as package.module:Factory)")


def create(name: str, config: CacheConfig) -> Backend:
    return resolve(name).create(config)
