"""One role each, for runs across machines: `sampler`, `validator`, `learner`, `evaluator`."""

from __future__ import annotations

from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def register_sampler(sub) -> None:
    p = sub.add_parser("sampler", help="run one sampler (generate rollouts, publish to Kafka)",
                       description="Generates groups with the run's current policy and publishes them, signed "
                                   "with its key, to the rollout topic. Its key must be registered in the run: "
                                   "`heterorl keys add ID --config C`, then `heterorl sampler --config C --id ID`. "
                                   "To join a run that `heterorl train` started, use that run's "
                                   "RUN_DIR/config.yaml as C. See docs/security.md.")
    add_config_args(p)
    p.add_argument("--id", dest="sampler_id", metavar="ID",
                   help="sampler id, the one its key was registered for (default: host-pid-random, which has "
                        "no registered key: it runs only with security.require_signatures off)")
    p.add_argument("--key", metavar="FILE", help="its signing key file (default: security.sampler_key, else "
                                                 "<keys_dir>/samplers/<ID>.key; $HETERORL_SAMPLER_KEY wins)")


def _cmd_sampler(args) -> int:
    if args.key:
        args.overrides.append(f"security.sampler_key={args.key}")
    cfg = load_run_config(args, role="sampler")
    from producers.sampler import run_sampler

    return run_sampler(cfg, sampler_id=args.sampler_id)


def register_validator(sub) -> None:
    p = sub.add_parser("validator", help="check samplers' groups beside the learner and publish signed verdicts",
                       description="Reads its share of the rollout topic's partitions (leases in Redis, divided "
                                   "among the live validators), applies the learner's checks to every group and "
                                   "publishes a signed verdict to <topic>.verdicts. The learner uses them with "
                                   "validators.enabled. Its key must be registered: `heterorl keys add ID --role "
                                   "validator`. See docs/security.md.")
    add_config_args(p)
    p.add_argument("--id", dest="validator_id", required=True, metavar="ID",
                   help="validator id (its key must be registered with --role validator)")
    p.add_argument("--key", metavar="FILE", help="its signing key file (default: validators.validator_key, else "
                                                 "<keys_dir>/validators/<ID>.key; $HETERORL_VALIDATOR_KEY wins)")


def _cmd_validator(args) -> int:
    if args.key:
        args.overrides.append(f"validators.validator_key={args.key}")
    cfg = load_run_config(args, role="validator")
    from consumers.validator import run_validator

    return run_validator(cfg, args.validator_id)


def register_learner(sub) -> None:
    p = sub.add_parser("learner", help="run the learner (consume rollouts, DeepSpeed + GEPO, publish weights)",
                       description="One learner process, or learner.num_processes of them: started without a "
                                   "launcher it starts the other ranks itself; under torchrun or the deepspeed "
                                   "launcher each process is the rank they set (RANK, LOCAL_RANK, WORLD_SIZE).")
    add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR",
                   help="run directory for metrics (default: train.out_dir, else runs/<run.name>)")


def _cmd_learner(args) -> int:
    cfg = load_run_config(args, role="learner")
    from consumers.learner import run_learner

    return run_learner(cfg, Path(args.out) if args.out else None)


def register_evaluator(sub) -> None:
    p = sub.add_parser("evaluator", help="score published policy versions on the held-out split as they appear",
                       description="Watches Redis for new policy versions of the run, scores every "
                                   "eval.every-th (and the last) on the held-out split, appends the results "
                                   "to RUN_DIR/metrics.jsonl, and exits after the last version.")
    add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR", help="run directory whose metrics.jsonl gets the records "
                                                    "(default: train.out_dir, else runs/<run.name>)")
    p.add_argument("--without-v0", action="store_true",
                   help="leave v0 (the base model) to the command that started this evaluator: `heterorl train` "
                        "scores it itself while the roles start (train.fast_start)")


def _cmd_evaluator(args) -> int:
    cfg = load_run_config(args)
    from producers.evaluator import run_evaluator

    return run_evaluator(cfg, Path(args.out) if args.out else None, without_v0=args.without_v0)


COMMANDS = {"sampler": (register_sampler, _cmd_sampler), "validator": (register_validator, _cmd_validator), "learner": (register_learner, _cmd_learner), "evaluator": (register_evaluator, _cmd_evaluator)}
