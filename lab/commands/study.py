"""`heterorl study delay` and `study pilot`: experiments made of many real runs (lab/study.py, lab/lr_pilot.py)."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from heterorl.commands.common import DEFAULT_DATA_DIR, config_help, keep_checkpoints_option
from heterorl.config_files import config_path
from pipeline.config import ConfigError, LossType, load_config


def _comma_list(text: str, kind=str) -> list:
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--max-delays and --seeds take comma-separated integers ({e})") from None


def register_study(sub) -> None:
    p = sub.add_parser("study", help="experiments made of many real runs (see `heterorl study delay --help`)")
    studies = p.add_subparsers(dest="study", metavar="STUDY", required=True)
    p = studies.add_parser("delay", help="loss x max-delay grid with simulated WAN delays, the paper's table",
                           description="Runs every (loss, max delay, seed) cell as a real pipeline run "
                                       "(local stack, learner, delayed samplers, evaluator) and writes "
                                       "delay_study.json, delay_study.md and plots into --out.")
    p.add_argument("--losses", help="comma-separated loss types (default: the config's study.losses; "
                                    "--quick: gepo,grpo)")
    p.add_argument("--max-delays", help="comma-separated max delays in steps (default: the config's "
                                        "study.max_delays; --quick: its smallest, and its largest below 50)")
    p.add_argument("--seeds", help="comma-separated seeds (default: the config's study.seeds; --quick: the first)")
    p.add_argument("--out", required=True, metavar="DIR", help="study directory (finished cells are reused)")
    p.add_argument("--quick", action="store_true",
                   help="a small grid (gepo,grpo x the config's smallest max delay and its largest one below "
                        "the 50 steps each cell runs, first seed) "
                        "unless --losses/--max-delays are given")
    p.add_argument("--config", "-c", default="study", metavar="NAME|FILE",
                   help=f"base run config: {config_help()} (default study)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every cell (repeatable)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="local stack directory")
    keep_checkpoints_option(p)
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write the report from the cells already finished in --out (missing ones "
                        "show as -), e.g. cells run apart and gathered into DIR/cells/")

    p = studies.add_parser("pilot", help="learning-rate pilot: learning speed vs delayed KL, before a grid",
                           description="For each --lrs rate, runs the delay study's max-delay-0 cell and its "
                                       "largest-max-delay cell (one loss, one seed), then writes pilot.json, "
                                       "pilot.md and pilot.png into --out: how fast each rate learns with fresh "
                                       "data against the learner-sampler KL of delayed data, and the rate that "
                                       "gives a KL around 1e-3 while gaining 10 points within 1000 steps, if any.")
    p.add_argument("--lrs", required=True, help="comma-separated learning rates, e.g. 5e-4,1e-4,2e-5")
    p.add_argument("--loss", default="gepo", choices=typing.get_args(LossType),
                   help="loss of every pilot cell (default gepo)")
    p.add_argument("--max-delay", type=int, metavar="STEPS",
                   help="the delayed cells' max delay (default: the largest of the config's study.max_delays)")
    p.add_argument("--seed", type=int, default=0, help="seed of every pilot cell (default 0)")
    p.add_argument("--out", required=True, metavar="DIR", help="pilot directory (finished cells are reused)")
    p.add_argument("--config", "-c", default="seed_regime", metavar="NAME|FILE",
                   help=f"base run config: {config_help()} (default seed_regime)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every cell (repeatable), e.g. learner.max_steps=200")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="local stack directory")
    keep_checkpoints_option(p)


def _cmd_study(args) -> int:
    from lab.study import QUICK, quick_max_delays, run_delay_study

    config = config_path(args.config)
    if args.study == "pilot":
        return _cmd_pilot(args, config)
    overrides = [*(QUICK["overrides"] if args.quick else []), *args.overrides]
    grid = load_config(config, overrides).study  # the design fixed in the config file
    losses = args.losses or (QUICK["losses"] if args.quick else ",".join(grid.losses))
    quick_delays = ",".join(map(str, quick_max_delays(grid.max_delays)))
    delays = args.max_delays or (quick_delays if args.quick else ",".join(map(str, grid.max_delays)))
    seeds = args.seeds or ",".join(map(str, grid.seeds[:1] if args.quick else grid.seeds))
    return run_delay_study(config, _comma_list(losses), sorted(set(_comma_list(delays, int))),
                           _comma_list(seeds, int), Path(args.out), overrides, args.data_dir,
                           "heterorl " + " ".join(sys.argv[1:]), keep_checkpoints=args.keep_checkpoints,
                           report_only=args.report_only)


def _cmd_pilot(args, config: Path) -> int:
    from lab.lr_pilot import run_lr_pilot

    try:
        lrs = _comma_list(args.lrs, float)
    except ConfigError:
        raise ConfigError(f"--lrs takes comma-separated learning rates, got {args.lrs!r}") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise ConfigError(f"--lrs takes positive learning rates, got {args.lrs!r}")
    if args.max_delay is not None and args.max_delay <= 0:
        raise ConfigError("--max-delay must be > 0: the pilot compares it with max delay 0")
    largest = args.max_delay or max(load_config(config, args.overrides).study.max_delays)
    if largest <= 0:
        raise ConfigError(f"study.max_delays of {args.config} has no delay above 0: give --max-delay")
    return run_lr_pilot(config, lrs, args.loss, largest, args.seed, Path(args.out), args.overrides, args.data_dir,
                        "heterorl " + " ".join(sys.argv[1:]), keep_checkpoints=args.keep_checkpoints)


COMMANDS = {"study": (register_study, _cmd_study)}
