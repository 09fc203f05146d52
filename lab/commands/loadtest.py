"""`heterorl loadtest`: the capacity rig (lab/loadtest/)."""

from __future__ import annotations

import argparse
from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def _sampler_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sampler counts like 1,4,16, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected sampler counts >= 1 like 1,4,16, got {text!r}")
    return counts


def register_loadtest(sub) -> None:
    p = sub.add_parser("loadtest", help="how far one learner, Redis and broker scale: simulated samplers on modeled "
                                        "hardware, async against lock-step",
                       description="Starts a local stack in OUT/data and, for each fleet size, the product's learner "
                                   "(its optimizer step and model-sized checks modeled by their time) and N simulated "
                                   "samplers (the product's sampler code; generation modeled by each sampler's "
                                   "tokens/s from the fleet profile), each behind its own fault-proxy link. Measures "
                                   "loadtest.measure_s seconds per row, audits every group, then runs the lock-step "
                                   "baseline on the same fleets. Writes OUT/loadtest.json and OUT/loadtest.png "
                                   "(docs/loadtest.md). Exit status 1 if a group was lost or used twice.")
    add_config_args(p)
    p.add_argument("--samplers", metavar="N,N,...", type=_sampler_counts,
                   help="fleet sizes, one row each (default loadtest.samplers: 1,4,16,64,256)")
    p.add_argument("--out", required=True, metavar="DIR", help="new directory: loadtest.json, loadtest.png, each "
                                                               "case's logs and measurements, the servers' data")
    p.add_argument("--no-compare", action="store_true",
                   help="skip the async-against-lock-step comparison (loadtest.compare_fleets)")
    p.add_argument("--validators", type=int, default=0, metavar="K",
                   help="K modeled validators check the groups instead of the learner, in the rows of --samplers "
                        "(default 0)")
    p.add_argument("--keep-stack", action="store_true", help="leave the local stack in OUT/data running")


def _cmd_loadtest(args) -> int:
    args.config = args.config or "loadtest"
    cfg = load_run_config(args, local_stack=False)
    from lab.loadtest.rig import run_loadtest

    return run_loadtest(cfg, Path(args.out), args.samplers, compare=not args.no_compare, keep_stack=args.keep_stack,
                        validators=args.validators)


COMMANDS = {"loadtest": (register_loadtest, _cmd_loadtest)}
