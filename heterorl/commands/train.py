"""`train`: the main job."""

from __future__ import annotations

from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def register_train(sub) -> None:
    p = sub.add_parser("train", help="the main job: local stack + learner + samplers + evaluation + report",
                       description="Starts the local stack unless one is running or URLs are configured, "
                                   "runs one learner and train.num_samplers samplers as separate processes "
                                   "with live progress, evaluates before and after, writes metrics.jsonl, "
                                   "TensorBoard events, summary.json and a PNG plot, then stops what it started. "
                                   "The run is named <run.name>-<YYYYmmdd-HHMMSS> (e.g. demo-20261123-040837): "
                                   "its topic is <run>.rollouts, its weights are under s3://<bucket>/<run>/.")
    add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default: train.out_dir, else runs/<run>)")
    p.add_argument("--keep-stack", action="store_true",
                   help="leave the local stack running afterwards (with its topic, checkpoints and version); "
                        "without it the stack a run started is stopped when no other run uses it")


def _cmd_train(args) -> int:
    cfg = load_run_config(args, local_stack=False)  # a config mistake is reported before the heavy imports
    from heterorl.train import run_train

    return run_train(cfg, Path(args.out) if args.out else None,
                     keep_stack=args.keep_stack)


COMMANDS = {"train": (register_train, _cmd_train)}
