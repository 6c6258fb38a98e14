"""Plain-text tables for the terminal, shared by the CLI and the analyses that print."""
from __future__ import annotations

import pandas as pd


def print_table(df: pd.DataFrame, columns) -> None:
    """A plain table: text left-aligned, numbers right-aligned, floats to 4 significant digits."""
    cols = [c for c in columns if c in df.columns]

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[cell(v) for v in row] for row in df[cols].itertuples(index=False)]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in cols]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(cols)]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w)
                         for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line(cols))
    for r in cells:
        print(line(r))
