"""Small factories shared by the tests: a tiny-model config and hand-written traces.

Import them as ``from conftest import make_config, make_trace, P, A, K, X``.
"""
from __future__ import annotations

import dataclasses
import os
import signal

import pytest

from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Append, Fork, Free, Header, Prefill, Trace, validate

TINY = get_model("tiny")  # 2 layers, 2 KV heads, head 8, fp16: 128 B per token


def make_config(block_size: int = 16, num_blocks: int = 64, **overrides) -> CacheConfig:
    """A CacheConfig on the tiny model (vLLM-style ``make_kv_cache_config(block_size, num_blocks)``)."""
    return CacheConfig(model=TINY, block_size=block_size, num_blocks=num_blocks, **overrides)


# Operations without a step: make_trace numbers them 0, 1, 2, ... in order.
def P(seq: int, tokens: int, tenant: str = "a") -> tuple:
    return ("prefill", seq, tokens, tenant)


def A(*pairs) -> tuple:
    """A batched append: A((seq, tokens), (seq, tokens), ...)."""
    return ("append", tuple(pairs))


def K(seq: int, src: int) -> tuple:
    """Fork: ``seq`` shares every block of ``src``."""
    return ("fork", seq, src)


def X(seq: int) -> tuple:
    return ("free", seq)


def make_ops(*specs) -> list:
    """Ops from P/A/K/X specs, or op objects (any step: renumbered in order)."""
    ops = []
    for step, spec in enumerate(specs):
        if not isinstance(spec, tuple):
            ops.append(dataclasses.replace(spec, step=step))
            continue
        kind = spec[0]
        if kind == "prefill":
            ops.append(Prefill(step, spec[1], spec[3], spec[2]))
        elif kind == "append":
            ops.append(Append(step, tuple(s for s, _ in spec[1]), tuple(t for _, t in spec[1])))
        elif kind == "fork":
            ops.append(Fork(step, spec[1], spec[2]))
        else:
            ops.append(Free(step, spec[1]))
    return ops


def make_trace(*specs, name: str = "hand", tenants: dict | None = None, family: str = "test") -> Trace:
    """A validated in-memory trace from P/A/K/X specs."""
    header = Header(family=family, generator="tests", tenants=dict(tenants or {}))
    return validate(Trace(header, make_ops(*specs), name=name))


def default_sigint() -> None:
    """A ``preexec_fn`` for a child the test interrupts: a child of a process that ignores SIGINT
    (a background job, nohup) inherits that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def backends(*tags: str, where=None, without=("engine",)) -> list:
    """Registered backends carrying every one of ``tags`` and none of ``without`` (the engines
    run in their own opt-in environments), whose capabilities pass ``where`` — each test's list
    of backends derived from the registry, so that a backend added there is tested."""
    from kvbench.contract import registry
    out = []
    for name in registry.tagged(*tags):
        entry = registry.resolve(name)
        if entry.tags & set(without):
            continue
        if where is not None:
            try:
                caps = entry.load().capabilities
            except Exception:  # an optional dependency missing: listed, then skipped where it runs
                out.append(name)
                continue
            if not where(caps):
                continue
        out.append(name)
    return out


def without_block_state(cls):
    """``cls`` exposing no block structures (Backend's block_state: NotImplementedError), so the
    checker holds it to its ledger, figures and events alone, as before an adapter had them."""
    from kvbench.contract.protocol import Backend
    return type(f"No{cls.__name__}", (cls,), {"block_state": Backend.block_state})


def require_sglang() -> None:
    """Skip where SGLang is not installed (opt-in, not in CI); fail where it is but cannot run."""
    from impls.engines.sglang_radix import NOT_INSTALLED, available
    ok, why = available()  # imports SGLang the adapter's way (its _torchvision_importable)
    if why == NOT_INSTALLED:
        pytest.skip("SGLang is not installed (opt-in, not in CI): see docs/engines.md for its recipe")
    assert ok, why  # installed but broken: say so, never skip


@pytest.fixture(scope="module")
def sglang():
    """The SGLang engine tests' guard: require_sglang once a module."""
    require_sglang()


@pytest.fixture(autouse=True, scope="session")
def _expectations_cache(tmp_path_factory):
    """The checks of the tests store their expectations in a folder of their own, never the
    user's cache."""
    os.environ["KVBENCH_CACHE"] = str(tmp_path_factory.mktemp("kvbench-cache"))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``timing`` run only when asked (KVBENCH_TIMING_TESTS=1): on a shared machine
    their ratio sits within the load's noise of the floor, and a verdict of noise gates nothing."""
    if os.environ.get("KVBENCH_TIMING_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="a speed ratio near its floor: set KVBENCH_TIMING_TESTS=1 to run it")
    for item in items:
        if "timing" in item.keywords:
            item.add_marker(skip)


def counting_calls(cls):
    """A subclass of backend ``cls`` that counts its finished mutating calls in ``self.calls``:
    a planted fault that turns on after the n-th operation reads it."""
    class Counting(cls):
        calls = 0

        def _counted(self, result):
            self.calls += 1
            return result

        def prefill(self, *a, **kw):
            return self._counted(super().prefill(*a, **kw))

        def append(self, *a, **kw):
            return self._counted(super().append(*a, **kw))

        def fork(self, *a, **kw):
            return self._counted(super().fork(*a, **kw))

        def free(self, *a, **kw):
            return self._counted(super().free(*a, **kw))

    return Counting


ENGINE_LIFECYCLE_REASONS = ("does not take a prompt in chunks", "does not roll back draft tokens")


def engine_lifecycle_na(trace, v) -> bool:
    """True, having asserted it n/a with the reason, when ``trace`` writes prompts in chunks or
    speculates (SPEC §13), which the vLLM block-pool and SGLang adapters do not drive (vLLM's
    manager does); False for any other trace."""
    from kvbench.checking.applicable import lifecycle
    if not lifecycle(trace) & {"chunked", "speculative"}:
        return False
    assert v.valid is None and any(r in v.not_applicable for r in ENGINE_LIFECYCLE_REASONS), v.not_applicable
    return True
