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

from kvbench.contract.protocol import Backend, CacheConfig

ENTRY_POINT_GROUP = "kvbench.backends"


class BackendUnavailable(NotImplementedError):
    """A backend that cannot be made here: its import fails, ``available()`` says no, its factory
    does not take a CacheConfig or returns something else than a Backend, or it refuses the
    settings. The message is one line: the reason. (A NotImplementedError, so that the asv suite
    and the gates report such a case n/a, as they do a backend a commit lacks.)"""


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: str  # "package.module:Factory"
    origin: str = "built-in"
    overrides: dict = field(default_factory=dict)  # CacheConfig fields this entry fixes

    def load(self):
        module, _, attr = self.target.partition(":")
        if not attr:
            raise ValueError(f"backend target {self.target!r} must look like 'package.module:Factory'")
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj

    def available(self) -> tuple[bool, str]:
        try:
            factory = self.load()
        except Exception as e:  # an optional dependency that is missing, a typo in a plug-in
            return False, f"cannot import {self.target}: {type(e).__name__}: {e}"
        check = getattr(factory, "available", None)
        return check() if callable(check) else (True, "")

    def create(self, config: CacheConfig) -> Backend:
        """A backend for ``config``, or BackendUnavailable saying in one line why not."""
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
        except Exception as e:
            raise BackendUnavailable(f"{self.name} cannot run with these settings: "
                                     f"{type(e).__name__}: {e}") from e
        if not isinstance(backend, Backend):
            raise BackendUnavailable(f"{self.target} made a {type(backend).__name__}, not a "
                                     f"kvbench Backend (subclass kvbench.protocol.Backend)")
        if backend.name == Backend.name:
            backend.name = self.name
        return backend


BUILTIN = [
    BackendEntry("numpy", "impls.numpy_paged:NumpyPaged"),
    BackendEntry("torch", "impls.torch_paged:TorchPaged"),
    BackendEntry("numpy-int8", "impls.numpy_quant_paged:NumpyQuantPaged", overrides={"kv_format": "int8"}),
    BackendEntry("numpy-int4", "impls.numpy_quant_paged:NumpyQuantPaged", overrides={"kv_format": "int4"}),
    BackendEntry("contiguous-max", "impls.contiguous:Contiguous", overrides={"reservation": "max"}),
    BackendEntry("contiguous-pow2", "impls.contiguous:Contiguous", overrides={"reservation": "pow2"}),
    BackendEntry("contiguous-oracle", "impls.contiguous:Contiguous",
                 overrides={"reservation": "oracle"}),
    BackendEntry("vllm-blockpool", "impls.engines.vllm_blockpool:VllmBlockPool"),
    BackendEntry("vllm-kvmanager", "impls.engines.vllm_kvmanager:VllmKVManager"),
    BackendEntry("sglang-radix", "impls.engines.sglang_radix:SglangRadix"),
    BackendEntry("sglang-radix-lfu", "impls.engines.sglang_radix:SglangRadixLFU"),
    # The straightforward per-object model: a reference for speed ratios, ledger only.
    BackendEntry("python-objects", "impls.object_model:ObjectModel"),
]

# What `kvbench run` replays by default: one of each design (both quantized pools: int4 packs two
# codes a byte and stores a zero point, int8 does neither), plus torch where it can run.
DEFAULT_BACKENDS = ("numpy", "torch", "numpy-int8", "numpy-int4", "contiguous-max",
                    "contiguous-pow2", "contiguous-oracle")


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
