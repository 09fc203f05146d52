"""`replay` (training on a recorded rollout topic) and `export` (a topic as Parquet)."""

from __future__ import annotations

import argparse
from pathlib import Path

from heterorl.commands.common import add_config_args, load_run_config


def register_replay(sub) -> None:
    p = sub.add_parser("replay", help="train a fresh learner on a recorded rollout topic (offline ablations)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Trains from --base on the groups recorded in --source, with no sampler. "
                                   "Each group keeps the staleness the original learner recorded in its update "
                                   "log, and the replay's own learner.* rules judge it again. Writes "
                                   "metrics.jsonl, TensorBoard events, updates.jsonl, checkpoints and "
                                   "summary.json (with final_checkpoint) into --out; with eval.every set, the "
                                   "same held-out accuracy records as a training run.",
                       epilog="Pass the original run's config (RUN_DIR/config.yaml) to replay it as it was; with "
                              "--exact-batches and the same loss it reproduces the original weights. The numerics "
                              "(precision, rounding, attention kernel, threads, ZeRO stage, micro-batch tokens) are "
                              "the recorded run's, from its update log, except those given with --set; what still "
                              "differs (a setting given, the machine, torch) is named before the replay starts.")
    add_config_args(p)
    p.add_argument("--source", required=True, metavar="SOURCE",
                   help="kafka://HOST:PORT/TOPIC (kafka:///TOPIC: the configured or local-stack broker) or "
                        "the path of a .parquet file written by `heterorl export`")
    p.add_argument("--base", required=True, metavar="CHECKPOINT",
                   help="starting weights: s3://BUCKET/RUN/vN/ of a published version (e.g. the original "
                        "run's v0; endpoint and credentials from the config or the local stack) or a local "
                        "Hugging Face model directory")
    p.add_argument("--out", required=True, metavar="RUN_DIR", help="new run directory for the replay")
    p.add_argument("--loss", metavar="L", help="loss type to replay with (same as --set learner.loss_type=L)")
    p.add_argument("--exact-batches", action="store_true",
                   help="follow the original update log step by step (same groups, same batches); "
                        "default: groups in the order the original judged them, batched by learner.groups_per_step")
    p.add_argument("--from-time", metavar="T", help="only groups created at or after T (Unix seconds or ISO 8601)")
    p.add_argument("--to-time", metavar="T", help="only groups created at or before T")
    p.add_argument("--from-version", type=int, metavar="V", help="only groups sampled by policy version >= V")
    p.add_argument("--to-version", type=int, metavar="V", help="only groups sampled by policy version <= V")
    p.add_argument("--checkpoints", metavar="s3://BUCKET/PREFIX",
                   help="publish the replay's checkpoints to S3 (default: RUN_DIR/checkpoints/vN)")


def _cmd_replay(args) -> int:
    if args.loss:
        args.overrides.append(f"learner.loss_type={args.loss}")
    cfg = load_run_config(args)
    from consumers.replay import ReplayFilter, parse_time, run_replay
    from pipeline.clients.services import require_services

    source = args.source
    if source.startswith("kafka:///"):
        source = f"kafka://{require_services(cfg.services).kafka_bootstrap}/{source[len('kafka:///'):]}"
    flt = ReplayFilter(parse_time(args.from_time), parse_time(args.to_time), args.from_version, args.to_version)
    chosen = frozenset(o.split("=", 1)[0].strip() for o in args.overrides)  # kept over the recorded numerics
    summary = run_replay(cfg, source, args.base, Path(args.out), exact_batches=args.exact_batches, flt=flt,
                         checkpoints=args.checkpoints, chosen=chosen)
    print(f"replay {args.out}: {summary['final_policy_version']} steps with {summary['loss_type']}, "
          f"{summary['groups_used']} groups used / {summary['groups_dropped']} dropped, "
          f"final checkpoint {summary['final_checkpoint']}")
    return 0


def register_export(sub) -> None:
    p = sub.add_parser("export", help="write a rollout topic and its update log to one Parquet file",
                       description="Reads every message of --topic (and <run>.updates, if present) from the "
                                   "configured or local-stack broker and writes them to --out; docs/schema.md "
                                   "lists the columns. `heterorl replay --source FILE.parquet` trains on it.")
    add_config_args(p)
    p.add_argument("--topic", required=True, help="rollout topic, <run>.rollouts, e.g. demo-20261123-040837.rollouts "
                                                  "for a run `heterorl train` named demo-20261123-040837")
    p.add_argument("--out", required=True, metavar="FILE.parquet", help="Parquet file to write")
    p.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka to read from (default: configured or local stack)")


def _cmd_export(args) -> int:
    from pipeline.records.archive import export_topic
    from pipeline.clients.services import require_services
    from pipeline.trust.keyring import trusted_learner

    cfg = load_run_config(args)
    bootstrap = args.bootstrap or require_services(cfg.services).kafka_bootstrap
    summary = export_topic(bootstrap, args.topic, Path(args.out), trusted_learner(cfg))
    refused = (f"; update-log records not signed by the learner's key, left out: {summary.refused_update_records}"
               if summary.refused_update_records else "")
    print(f"wrote {summary.path}: {summary.messages} messages, {summary.steps} update-log steps{refused}")
    return 0


COMMANDS = {"replay": (register_replay, _cmd_replay), "export": (register_export, _cmd_export)}
