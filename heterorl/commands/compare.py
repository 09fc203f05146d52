"""`compare`: runs side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path



def register_compare(sub) -> None:
    p = sub.add_parser("compare", help="side-by-side table and accuracy plot of run directories",
                       description="Prints final and best held-out accuracy, mean KL, importance-weight "
                                   "variance and groups used/dropped of each run (train or replay), and "
                                   "plots their curves on one PNG.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", default="compare.png", metavar="FILE.png", help="plot to write (default compare.png)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")


def _cmd_compare(args) -> int:
    from heterorl.compare import compare_runs, format_table, plot_comparison

    dirs = [Path(d) for d in args.run_dirs]
    rows = compare_runs(dirs)
    print(json.dumps(rows, indent=2, default=str) if args.json else format_table(rows))
    print(f"plot: {plot_comparison(dirs, Path(args.out))}", file=sys.stderr)
    return 0


COMMANDS = {"compare": (register_compare, _cmd_compare)}
