"""The oracle's old path: the model is kvbench.model (kvbench/model/oracle.py)."""
from kvbench.model.oracle import (  # noqa: F401
    ModelOOM,
    Oracle,
    SeqState,
    TenantStats,
    content_segments,
    draft_writer,
    extra_keys,
    step,
)
