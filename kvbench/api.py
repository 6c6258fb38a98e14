"""kvbench's small, stable public surface.

What code outside kvbench may import without following the package's layout: the asv suite
(which must also import the kvbench of older commits, see kvbench/bench/fixtures.py),
plug-in backends, notebooks. Names are only ever added here, never moved or removed.
"""
from kvbench import quant
from kvbench.checking.checker import Divergence, Verdict, check
from kvbench.checking.driver import replay, replay_figures
from kvbench.contract import registry
from kvbench.contract.formulas import ModelSpec, blocks_needed, budget_blocks, get_model
from kvbench.contract.protocol import (
                                       Backend,
                                       CacheConfig,
                                       Capabilities,
                                       Ledger,
                                       OutOfMemory,
                                       Prompt,
                                       kv_tokens,
                                       kv_values,
)
from kvbench.model.oracle import Oracle
from kvbench.search.shrink import ShrinkResult, shrink
from kvbench.traces.format import (
                                       Append,
                                       Fork,
                                       Free,
                                       Header,
                                       Prefill,
                                       Trace,
                                       TraceError,
                                       load,
                                       loads,
                                       save,
)

__all__ = ["quant", "check", "Verdict", "Divergence", "Oracle", "registry", "ModelSpec",
           "blocks_needed", "budget_blocks", "get_model", "Backend", "CacheConfig", "Capabilities",
           "Ledger", "OutOfMemory", "kv_tokens", "kv_values", "Append", "Fork", "Free", "Header",
           "Prefill", "Trace", "TraceError", "load", "loads", "save", "shrink", "ShrinkResult",
           "Prompt", "replay", "replay_figures"]
