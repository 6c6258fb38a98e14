"""The checker's verdict as data: pass, FAIL with the first divergence (trace, step, operation,
quantity, expected, actual), ERROR when the harness could not check, n/a when the trace does not
apply; and the words a divergence is told in."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.checking.series import Series


@dataclass
class Divergence:
    trace: str
    index: int  # 0-based operation number in the trace
    step: int
    op: dict
    quantity: str
    expected: object
    actual: object
    detail: str = ""

    def __str__(self) -> str:
        where = f"step {self.step} (op #{self.index} {self.op})" if self.index >= 0 \
            else f"before step {self.step} ({self.op})"  # the backend's making
        return (f"{self.trace}: {where}: {self.quantity} "
                f"expected {_show(self.expected)}, got {_show(self.actual)}"
                + (f" ({self.detail})" if self.detail else ""))


def _show(value) -> str:
    """A figure as the verdict prints it: words as they are, anything else as its repr."""
    return value if isinstance(value, str) else repr(value)


OOM, SUCCESS = "out-of-memory", "success"  # the outcomes of a call


@dataclass
class Verdict:
    trace: str
    backend: str
    valid: bool | None  # None: not judged (not applicable, or an ERROR of the harness)
    ops: int = 0  # operations checked
    divergence: Divergence | None = None
    not_applicable: str = ""
    skipped: dict = field(default_factory=dict)  # what was not checked, and why
    ooms: int = 0
    evictions: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0  # the trace's preempt operations replayed (SPEC §13)
    gathers: int = 0
    events: int = 0  # KV events checked (SPEC §14)
    hits: int = 0  # operations that found the sequence they touch still resident
    misses: int = 0  # ... that found it evicted, and recomputed it
    tenants: dict = field(default_factory=dict)  # tenant -> {evictions, recomputed_tokens, hits, misses}
    backend_seconds: float = 0.0
    expectations: str = ""  # "reused" from the cache, "stored" in it, "stale" (wrong, removed),
    # "recomputed" (checked again after "stale", stored anew), "" neither
    expectations_saved: float = 0.0  # seconds of the oracle's work a reuse saved
    final_ledger: dict = field(default_factory=dict)
    # Prompt blocks found cached, by where (SPEC §11): {"device" or a tier: (backend's, oracle's)}
    hit_blocks: dict = field(default_factory=dict)
    series: Series = field(default_factory=Series)  # ledger figures after each operation
    # With keep_going: every class of divergence, {"kind", "first" (a Divergence), "count",
    # "stopped" (the replay stopped at one of them)}, in the order each first appeared.
    divergences: list = field(default_factory=list)
    error: str = ""  # why the harness could not check (status ERROR)
    traceback: str = ""  # of the backend's exception (FAIL) or the harness's (ERROR)

    @property
    def status(self) -> str:
        if self.error:
            return "ERROR"
        return {True: "pass", False: "FAIL", None: "n/a"}[self.valid]

    # The one shape of kvbench's verdicts (kvbench.quant's QuantVerdict has it too): valid,
    # status, failures (the first of each kind, in order: quantity, expected, actual, detail and
    # where), first, quantities(), failure(quantity), explain(), as_dict().
    @property
    def failures(self) -> tuple:
        if self.divergences:
            return tuple(c["first"] for c in self.divergences)
        return () if self.divergence is None else (self.divergence,)

    @property
    def first(self) -> Divergence | None:
        return self.failures[0] if self.failures else None

    def quantities(self) -> list:
        return [f.quantity for f in self.failures]

    def failure(self, quantity: str) -> Divergence | None:
        return next((f for f in self.failures if f.quantity == quantity), None)

    def explain(self) -> str:
        why = self.error or self.not_applicable or "; ".join(str(f) for f in self.failures)
        return f"{self.status} ({self.backend} on {self.trace})" + (f": {why}" if why else "")

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k not in ("series", "divergence", "divergences")}
        d["divergence"] = None if self.divergence is None else dict(self.divergence.__dict__)
        d["divergences"] = [{**c, "first": dict(c["first"].__dict__)} for c in self.divergences]
        d["status"] = self.status
        return d


def divergence_classes(v: Verdict) -> str:
    """'cached_blocks x12 from step 3; blocks_used x4 from step 9 (stopped)': a verdict that kept
    going, one class a clause."""
    return "; ".join(f"{c['kind']} x{c['count']} from step {c['first'].step}"
                     + (" (stopped)" if c["stopped"] else "") for c in v.divergences)


def refusal_detail(before, after) -> str:
    """Why a refused call's ledger change fails, naming the first sequence that differs, if any."""
    why = "an operation that fails must leave the cache exactly as it was"

    def held(led, s):
        return (f"{led.tokens[s]} tokens in {led.seq_blocks.get(s)} blocks" if s in led.tokens
                else "absent")

    for s in sorted(set(before.tokens) | set(after.tokens)):
        if held(before, s) != held(after, s):
            return f"{why}; sequence {s}: {held(before, s)} before, {held(after, s)} after"
    return why


def dict_diff(e: dict, a: dict) -> str:
    keys = sorted(set(e) | set(a))
    for k in keys:
        if e.get(k) != a.get(k):
            return f"sequence {k}: expected {e.get(k)}, got {a.get(k)}"
    return ""
