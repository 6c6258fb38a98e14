"""What every kvbench chart shares: one colour and one label per memory category, a line naming
where and when the figures were measured (commit, machine, date), and an atomic write."""
from __future__ import annotations

from pathlib import Path

from kvbench.contract.ledger import MEMORY_CATEGORIES
from kvbench.outputs import save_figure
from kvbench.provenance import commit_date, commit_info, machine_info

CATEGORY_LABELS = {c: c.replace("_", " ") for c in MEMORY_CATEGORIES}
CATEGORY_COLORS = {"token_states": "#4c72b0", "reservation": "#dd8452",
                   "internal_fragmentation": "#c44e52", "external_fragmentation": "#8172b3",
                   "free": "#cccccc"}


def provenance(rec: dict | None = None) -> str:
    """'commit abc12345 (dirty), host (cpu, 2 cpus), 2026-01-01 12:00 UTC' of a result record, or
    of this checkout and machine, dated by the commit: a chart drawn again from the same commit
    on the same machine is the same file, byte for byte (a committed chart stays clean)."""
    if rec is None:
        rec = {**commit_info(), "machine": machine_info(), "created": commit_date() or "?"}
    m = rec.get("machine", {})
    where = m.get("gpu") or m.get("device") or m.get("processor") or "?"
    created = str(rec.get("created", "?")).replace("T", " ").replace("+00:00", " UTC")
    return (f"commit {str(rec.get('commit', '?'))[:8]}{' (dirty)' if rec.get('dirty') else ''}, "
            f"{m.get('hostname', '?')} ({where}, {m.get('cpus', '?')} cpus), {created}")


def finish(fig, path, rec: dict | None = None, **savefig) -> Path:
    """Put the provenance line at the figure's foot and write it to ``path`` atomically."""
    fig.text(0.99, 0.005, provenance(rec), ha="right", va="bottom", fontsize=6, color="#555555")
    return save_figure(fig, path, **savefig)
