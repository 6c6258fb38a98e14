"""The verdict table of an engine results page from `kvbench run` records, one row per run.

    python scripts/engine_verdicts.py LABEL=RECORD.json [LABEL=RECORD.json ...] --out DIR

Writes DIR/verdicts.csv (settings label, workload, backend, its departures from the engine's
serving default, block size, blocks, status, operations checked, refusals, peak blocks, first
divergence or the reason it is n/a, what the checker could not check on it) and DIR/run.json (the records' rows without their
per-operation series, under their labels).
"""
from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

COLUMNS = ["settings", "workload", "backend", "serving_departures", "block_size", "num_blocks",
           "status", "ops", "ooms", "peak_blocks", "divergence", "skipped"]


def rows_of(label: str, record: dict) -> list[dict]:
    out = []
    for r in record["rows"]:
        row = {k: r.get(k, "") for k in COLUMNS if k != "settings"}
        row["divergence"] = r.get("divergence") or r.get("not_applicable") or ""
        out.append({"settings": label, **row})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="LABEL=RECORD.json")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args(argv)
    rows, runs = [], {}
    for item in args.records:
        label, sep, path = item.partition("=")
        if not sep:
            p.error(f"{item}: expected LABEL=RECORD.json")
        record = json.loads(Path(path).read_text())
        rows += rows_of(label, record)
        runs[label] = {**{k: v for k, v in record.items() if k != "rows"},
                       "rows": [{k: v for k, v in r.items() if k != "series"} for r in record["rows"]]}
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "verdicts.csv", "w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (args.out / "run.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(f"wrote {args.out / 'verdicts.csv'} ({len(rows)} rows) and {args.out / 'run.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
