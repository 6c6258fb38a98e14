"""Planted backends for the verdict and CLI tests: a correct NumPy pool with one defect each,
importable by the registry as ``planted:Name`` (tests/ is on sys.path under pytest)."""
from __future__ import annotations

import dataclasses

from impls.faults_edges import PrefillKeepsBlockOnRefusal
from impls.numpy_paged import NumpyPaged


class LedgerRaises(NumpyPaged):
    """ledger() raises once the pool holds a sequence: every trace FAILs at its first op."""

    name = "ledger-raises"

    def ledger(self, seqs=None):
        if self.row_of:
            raise ZeroDivisionError("planted: ledger() of a non-empty pool")
        return super().ledger(seqs)


def raising_in(call: str):
    """A NumPy pool whose ``call`` raises RuntimeError the first time it is made."""

    class Raises(NumpyPaged):
        name = f"raises-in-{call}"

    def boom(self, *args, **kwargs):
        raise RuntimeError(f"planted: {call} raises")

    setattr(Raises, call, boom)
    return Raises


class LeaksOnRefusal(PrefillKeepsBlockOnRefusal):
    """A prefill refused for lack of blocks keeps one block it took before finding out."""

    name = "leaks-on-refusal"


class NotABackend:
    """A factory that returns something else than a Backend."""

    def __init__(self, config):
        self.config = config


def two_argument_factory(config, extra):
    """A factory with the wrong signature."""
    return NumpyPaged(config)


RaisesInClose = raising_in("close")


class NoFork(NumpyPaged):
    """Declares no fork: every trace that forks is n/a for it."""

    name = "no-fork"
    capabilities = dataclasses.replace(NumpyPaged.capabilities, fork=False)
