"""`lmlab ledger FILE [--json]`: a fixed-budget ledger (`python train.py budget.wall=300 ledger=FILE`,
lmlab.record.ledger) as a table, best first, each row's difference to the best and whether it is above the ledger's
own noise floor (lmlab.analysis.ledger says how it is taken); the runs that did not complete follow, with their status.

    lmlab ledger runs.jsonl            # the table
    lmlab ledger runs.jsonl --json     # the same for scripts: metric, floor, rows (rank, diff, above_floor), unranked

A line that is not a row (a hand edit) is reported on stderr, `FILE:N: skipped: why`, and the rest is read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lmlab.analysis.ledger import ranked, table
from lmlab.record.ledger import read


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A fixed-budget ledger's rows best first, with the noise floor.")
    p.add_argument("file", type=Path, help="the ledger (ledger= of python train.py): one JSON row a line")
    p.add_argument("--json", action="store_true", help="the table as JSON, for scripts")
    return p


def run(prog: str, argv: Sequence[str]) -> None:
    args = parser(prog).parse_args(list(argv))
    if not args.file.is_file():
        why = "is not a file" if args.file.exists() else "does not exist"
        print(f"{prog}: {args.file} {why} (a ledger is the file of `python train.py ... ledger=<file>`)",
              file=sys.stderr)
        raise SystemExit(2)
    rows, bad = read(args.file)
    for n, why in bad:
        print(f"{prog}: {args.file}:{n}: skipped: {why}", file=sys.stderr)
    result = ranked(rows)
    if args.json:
        print(json.dumps({"ledger": str(args.file), **result, "bad_lines": [{"line": n, "why": w} for n, w in bad]},
                         indent=2))
    else:
        print(table(result, str(args.file)))


if __name__ == "__main__":
    run("python -m lmlab.commands.ledger", sys.argv[1:])
