"""What every command shares: the config options, and loading the config a command runs with."""

from __future__ import annotations

import argparse

from heterorl.config_files import builtin_configs, config_path
from pipeline.config import HeteroConfig, load_config

DEFAULT_DATA_DIR = ".heterorl"


def config_help() -> str:
    return (f"a built-in config ({', '.join(builtin_configs())}) or a YAML file; defaults are used for "
            "missing fields")


def keep_checkpoints_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every policy version and recovery state of each cell in S3 (default: a "
                        "finished cell keeps v0 and the final version, with its delta chain, a failed one "
                        "nothing; a real model's cell is GBs)")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="NAME|FILE", help=config_help())
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set learner.lr=3e-4 (repeatable)")
    p.add_argument("--data-dir", metavar="DIR",
                   help=f"local stack directory (default: services.data_dir, i.e. {DEFAULT_DATA_DIR}/)")


def load_run_config(args, local_stack: bool = True, role: str = "admin") -> HeteroConfig:
    """The command's config; with `local_stack`, servers not configured are taken from the
    local stack running in the data dir (if any), Redis as the stack's user `role`."""
    overrides = list(args.overrides)
    if getattr(args, "data_dir", None):
        overrides.append(f"services.data_dir={args.data_dir}")
    cfg = load_config(config_path(args.config), overrides)
    if local_stack:
        from heterorl.stack import with_local_stack

        cfg = with_local_stack(cfg, role)
    return cfg
