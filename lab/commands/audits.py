"""Runs that end in an audit: `heterorl attack` (adversarial samplers), `chaos` (seeded faults) and `wan`
(samplers behind shaped links), and `adversary`, one adversarial sampler."""

from __future__ import annotations

import sys
from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config
from heterorl.commands.invites import DEFAULT_JOIN_HOME
from pipeline.config import ConfigError


def register_attack(sub) -> None:
    p = sub.add_parser("attack", help="train with honest samplers plus one adversary of each kind, then audit",
                       description="Runs a training run on a local stack of its own (OUT/data) with honest "
                                   "samplers and adversaries: forged rewards, noisy log-probs, another model, a "
                                   "false policy version, bad or missing signatures, replayed messages and a "
                                   "tampered checkpoint in S3. Writes OUT/attack_audit.json; exit 1 if a target "
                                   "is missed. See docs/security.md.")
    add_config_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="where the audit, logs and the run's data go")
    p.add_argument("--minutes", type=float, default=3.0, help="how long to train before draining (default 3)")
    p.add_argument("--samplers", type=int, default=2, help="honest samplers (default 2)")
    p.add_argument("--validators", type=int, default=0, metavar="K",
                   help="check groups by K validators (and forge verdicts too) instead of in the learner (default 0)")
    p.add_argument("--no-stranger", action="store_true",
                   help="leave out the stranger (an invite's holder trying the servers themselves, then revoked): "
                        "a baseline for the honest samplers' pace")


def _cmd_attack(args) -> int:
    cfg = load_run_config(args, local_stack=False)
    from lab.attack import run_attack

    return run_attack(cfg, Path(args.out), args.minutes, args.samplers, args.validators,
                      stranger=not args.no_stranger)


ADVERSARY_KINDS = ("forged_rewards", "noisy_logprobs", "other_model", "false_version", "bad_signature", "stale_prober")
"""`lab.adversaries.SAMPLER_KINDS`, named here so that `--help` imports no torch (tests/unit/test_cli.py checks they agree)."""


def register_adversary(sub) -> None:
    p = sub.add_parser("adversary", help="run one adversarial sampler (what `heterorl attack` starts)",
                       description="A sampler with a key of its own that lies in one way: " +
                                   ", ".join(ADVERSARY_KINDS) + ". Its key is registered, or with --invite it "
                                   "joins as `heterorl join` does (its own key, admitted by the learner), and "
                                   "--config / --set then change its fields as join's do. For testing the "
                                   "learner's defences only.")
    p.add_argument("kind", choices=ADVERSARY_KINDS, help="what it does wrong (lab/adversaries.py)")
    add_config_args(p)
    p.add_argument("--id", dest="sampler_id", required=True, metavar="ID",
                   help="sampler id (its key must be registered, unless it joins with --invite)")
    p.add_argument("--invite", dest="invite_file", metavar="FILE",
                   help="join with the invite in FILE (`heterorl invite`) instead of a registered key")
    p.add_argument("--home", default=DEFAULT_JOIN_HOME, metavar="DIR",
                   help=f"with --invite: where it keeps its key, id and spool (default {DEFAULT_JOIN_HOME}/)")


def _cmd_adversary(args) -> int:
    if args.invite_file is None:
        cfg, sampler_id = load_run_config(args, role="sampler"), args.sampler_id
    else:  # a stranger: admitted under the invite like any volunteer, then it lies
        from heterorl.invites import be_admitted, read_invite_file

        if args.data_dir:
            raise ConfigError("--data-dir: an adversary that joins with --invite keeps its key and spool in --home")
        admitted = be_admitted(read_invite_file(Path(args.invite_file)), base=Path(args.home),
                               config_file=args.config, overrides=args.overrides, sampler_id=args.sampler_id)
        cfg, sampler_id = admitted.cfg, admitted.sampler_id
        print(f"adversary {args.kind} joined run {admitted.invite.run} as {sampler_id} (key {admitted.key.key_id}, "
              f"invite {admitted.invite.grant.grant_id})", file=sys.stderr, flush=True)
    from lab.adversaries import run_adversary

    return run_adversary(args.kind, cfg, sampler_id)


def register_chaos(sub) -> None:
    p = sub.add_parser("chaos", help="train through seeded faults, then audit that no rollout was lost or reused",
                       description="Starts a durable local stack in OUT/data behind a TCP fault proxy, a learner "
                                   "and N samplers; on a seeded schedule kills and restarts samplers, adds and "
                                   "removes them, kills and restarts the learner once, restarts the broker once and "
                                   "cuts the samplers off from everything for --partition-s seconds, with latency, "
                                   "jitter and connection resets on the samplers' links throughout. Then stops the "
                                   "samplers, drains the learner and writes OUT/audit.json. Exit status 1 if a "
                                   "rollout was lost or used twice.")
    add_config_args(p)
    p.add_argument("--minutes", type=float, default=15.0, help="how long faults are injected (default 15)")
    p.add_argument("--samplers", type=int, default=3, help="samplers at the start (default 3)")
    p.add_argument("--partition-s", type=float, default=30.0,
                   help="length of the window in which the samplers reach nothing (default 30)")
    p.add_argument("--validators", type=int, default=0, metavar="K",
                   help="check groups by K validators instead of in the learner, and kill one mid-run (default 0)")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="new directory: logs, metrics, the servers' data (OUT/data), audit.json; --data-dir "
                        "only locates the cached base model")
    p.add_argument("--keep-stack", action="store_true", help="leave the local stack in OUT/data running")


def _cmd_chaos(args) -> int:
    cfg = load_run_config(args, local_stack=False)
    from lab.chaos import run_chaos

    return run_chaos(cfg, Path(args.out), args.minutes, args.samplers, args.partition_s,
                     keep_stack=args.keep_stack, validators=args.validators)


def register_wan(sub) -> None:
    p = sub.add_parser("wan", help="train with samplers behind shaped WAN links, and report what each link costs",
                       description="A rehearsal of a run across the internet on one machine: the servers and the "
                                   "learner here; each sampler whose link is shaped on a host of its own (a network "
                                   "namespace) behind a kernel rate limit (tc tbf) and a fault proxy (delay, "
                                   "jitter, connection resets); a link with join= gets a volunteer that joins then "
                                   "with only an invite. Writes OUT/wan_report.json and OUT/wan_report.png and "
                                   "prints a table: per sampler the keyframe and delta bytes, seconds to its first "
                                   "group used, groups sent, used, dropped, refused; the learner's pace. Exit status "
                                   "1 if a rollout was lost or used twice. Needs root and iproute2 (ip, tc). See "
                                   "docs/deployment.md, \"What link a sampler needs\".")
    add_config_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="new directory: the report, each arm's logs and data")
    p.add_argument("--minutes", type=float, default=10.0, help="how long the samplers run, per arm (default 10)")
    p.add_argument("--link", dest="links", action="append", default=[], metavar="'NAME [rate=MBIT] [delay=MS] "
                   "[jitter=MS] [reset=S] [join=S]'",
                   help="a sampler and its link (repeatable; replaces the default four: A unshaped; B rate=50 "
                        "delay=40 jitter=4; C rate=10 delay=150 jitter=15 reset=120; D rate=10 delay=150 "
                        "jitter=15 join=180)")
    p.add_argument("--compare-unshaped", action="store_true",
                   help="then run the same again with every link unshaped, the reference the targets compare with")


def _cmd_wan(args) -> int:
    cfg = load_run_config(args, local_stack=False)
    from lab.wan import DEFAULT_LINKS, WanLink, run_wan

    links = [WanLink.parse(text) for text in args.links] or list(DEFAULT_LINKS)
    return run_wan(cfg, Path(args.out), args.minutes, links, args.compare_unshaped)


COMMANDS = {"wan": (register_wan, _cmd_wan), "attack": (register_attack, _cmd_attack), "adversary": (register_adversary, _cmd_adversary), "chaos": (register_chaos, _cmd_chaos)}
