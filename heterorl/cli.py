"""`heterorl` (or `python -m heterorl`): one command per role, each a thin entry point.

Every subcommand parses its arguments, loads the typed config (a shipped config by name,
or a file), and calls one function. The command modules, and with them torch,
transformers and deepspeed, are imported only by the command that needs them, and only
after its config has loaded, so `heterorl --help` and a mistake in the config answer at once. A user mistake (`pipeline.errors.UserError`: a bad config,
an unreachable server, a bad file) ends in one line on stderr, exit status 2; a run whose
process failed (`RunFailed`) in one line plus that process's last log lines, exit
status 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import typing
from pathlib import Path

from heterorl.config_files import builtin_configs, config_path
from heterorl.processes import RunFailed
from pipeline.config import ConfigError, HeteroConfig, LossType, load_config, strip_password
from pipeline.errors import UserError

DEFAULT_DATA_DIR = ".heterorl"

EXAMPLES = """\
examples:
  heterorl train --config demo                       # the whole loop on a local stack
  heterorl up && eval "$(heterorl env)"              # start servers, point kcat/redis-cli/aws at them
  heterorl learner --config demo --out runs/x
  heterorl keys init && heterorl keys add my-gpu-box # signing keys (docs/security.md)
  heterorl sampler --config demo --id my-gpu-box     # start as many as you like, anywhere
  heterorl status --json
  heterorl replay --source kafka:///demo.rollouts --base s3://heterorl/demo/v0/ --out runs/gspo --loss gspo
  heterorl export --topic demo.rollouts --out demo.parquet
  heterorl weights fetch s3://heterorl/demo/v100/ --out final-model  # a verified HF directory
  heterorl compare runs/demo runs/gspo
  heterorl chaos --minutes 15 --samplers 3 --out runs/chaos   # faults + audit.json
  heterorl loadtest --samplers 1,4,16 --out runs/loadtest   # capacity rig: loadtest.json + PNG
  heterorl attack --config demo --minutes 3 --out runs/attack # adversaries + attack_audit.json
  heterorl down                                      # data is kept; --wipe deletes it
"""


def _config_help() -> str:
    return (f"a built-in config ({', '.join(builtin_configs())}) or a YAML file; defaults are used for "
            "missing fields")


def _keep_checkpoints_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-checkpoints", action="store_true",
                   help="keep every policy version and recovery state of each finished cell in S3 (default: "
                        "keep v0 and the final version, with its delta chain; a real model's cell is GBs)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="NAME|FILE", help=_config_help())
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set learner.lr=3e-4 (repeatable)")
    p.add_argument("--data-dir", metavar="DIR",
                   help=f"local stack directory (default: services.data_dir, i.e. {DEFAULT_DATA_DIR}/)")


def _load(args, local_stack: bool = True, role: str = "admin") -> HeteroConfig:
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="heterorl", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES,
        description="Asynchronous RL post-training over an unreliable WAN: samplers publish "
                    "version-tagged rollouts to Kafka, a DeepSpeed learner trains with GEPO and "
                    "publishes weights to S3, Redis holds the current policy version.")
    # The deepspeed launcher puts --local_rank=N right after the module name (unless given
    # --no_local_rank); the LOCAL_RANK it also sets is what the learner reads.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("up", help="start the local stack (Kafka-API broker, Redis, S3) on loopback",
                       description="Start real servers on 127.0.0.1 and record them in DIR/stack.json. "
                                   "Every other command uses this stack unless service URLs are configured.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                   help=f"where server data, logs and the state file live (default {DEFAULT_DATA_DIR})")
    p.add_argument("--kafka-port", type=int, default=0, help="broker port (default: a free port)")
    p.add_argument("--redis-port", type=int, default=0, help="Redis port (default: a free port)")
    p.add_argument("--s3-port", type=int, default=0, help="S3 port (default: a free port)")
    p.add_argument("--external-kafka", metavar="HOST:PORT",
                   help="use this existing Kafka instead of starting a broker")

    p = sub.add_parser("down", help="stop the servers that `heterorl up` started (data is kept)",
                       description="Stops the recorded servers. Topics, checkpoints and Redis stay in DIR and "
                                   "are served again by the next `heterorl up`, unless --wipe.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")
    p.add_argument("--wipe", action="store_true",
                   help="also delete the stored topics, checkpoints and Redis data (logs are kept)")

    p = sub.add_parser("status", help="servers, policy version, checkpoints and live samplers",
                       description="Prints where the servers are and the state of one run. Never prints secrets.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")
    p.add_argument("--run", metavar="NAME", help="run to describe (default: the most recently started run)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")

    p = sub.add_parser("env", help="print `export` lines for the running local stack",
                       description='Use as: eval "$(heterorl env)" — then kcat, redis-cli, the aws CLI '
                                   "and boto3 talk to the local servers.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")

    p = sub.add_parser("keys", help="signing keys: init the run's root/learner keys, add/revoke/list sampler keys",
                       description="Samplers sign every rollout with their own Ed25519 key; the learner accepts "
                                   "only keys in the run's registry, which the root key signs and Redis holds. "
                                   "See docs/security.md.")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = actions.add_parser("init", help="make the root and learner keys (in security.keys_dir) if missing")
    _add_config_args(q)
    q = actions.add_parser("add", help="register a sampler (or validator) key (a new key pair, or --public-key)")
    _add_config_args(q)
    q.add_argument("sampler_id", metavar="ID", help="the id the sampler runs with (`heterorl sampler --id`), or the "
                                                    "validator's (`heterorl validator --id`)")
    q.add_argument("--role", choices=("sampler", "validator"), default="sampler",
                   help="what the key may sign: rollouts (sampler, the default) or verdicts on them (validator)")
    q.add_argument("--public-key", metavar="BASE64", help="register this public key instead of making a key pair")
    q.add_argument("--out", metavar="FILE", help="where to write the new private key "
                                                 "(default: <keys_dir>/<ROLE>s/<ID>.key)")
    q.add_argument("--days", type=float, metavar="N", help="lifetime (default: security.key_lifetime_days)")
    q = actions.add_parser("revoke", help="revoke a key (by key id, or every key of a sampler id)")
    _add_config_args(q)
    q.add_argument("name", metavar="KEY_ID|SAMPLER_ID")
    q = actions.add_parser("list", help="the run's registered sampler and validator keys and their status")
    _add_config_args(q)

    p = sub.add_parser("attack", help="train with honest samplers plus one adversary of each kind, then audit",
                       description="Runs a training run on a local stack of its own (OUT/data) with honest "
                                   "samplers and adversaries: forged rewards, noisy log-probs, another model, a "
                                   "false policy version, bad or missing signatures, replayed messages and a "
                                   "tampered checkpoint in S3. Writes OUT/attack_audit.json; exit 1 if a target "
                                   "is missed. See docs/security.md.")
    _add_config_args(p)
    p.add_argument("--out", required=True, metavar="DIR", help="where the audit, logs and the run's data go")
    p.add_argument("--minutes", type=float, default=3.0, help="how long to train before draining (default 3)")
    p.add_argument("--samplers", type=int, default=2, help="honest samplers (default 2)")
    p.add_argument("--validators", type=int, default=0, metavar="K",
                   help="check groups by K validators (and forge verdicts too) instead of in the learner (default 0)")

    p = sub.add_parser("adversary", help="run one adversarial sampler (what `heterorl attack` starts)",
                       description="A sampler with a registered key that lies in one way: " +
                                   ", ".join(("forged_rewards", "noisy_logprobs", "other_model", "false_version",
                                              "bad_signature")) + ". For testing the learner's defences only.")
    p.add_argument("kind", choices=("forged_rewards", "noisy_logprobs", "other_model", "false_version",
                                    "bad_signature"), help="what it does wrong")
    _add_config_args(p)
    p.add_argument("--id", dest="sampler_id", required=True, metavar="ID", help="sampler id (its key must be registered)")

    p = sub.add_parser("sampler", help="run one sampler (generate rollouts, publish to Kafka)")
    _add_config_args(p)
    p.add_argument("--id", dest="sampler_id", metavar="ID", help="sampler id (default: host-pid-random)")
    p.add_argument("--key", metavar="FILE", help="its signing key file (default: security.sampler_key, else "
                                                 "<keys_dir>/samplers/<ID>.key; $HETERORL_SAMPLER_KEY wins)")

    p = sub.add_parser("validator", help="check samplers' groups beside the learner and publish signed verdicts",
                       description="Reads its share of the rollout topic's partitions (leases in Redis, divided "
                                   "among the live validators), applies the learner's checks to every group and "
                                   "publishes a signed verdict to <topic>.verdicts. The learner uses them with "
                                   "validators.enabled. Its key must be registered: `heterorl keys add ID --role "
                                   "validator`. See docs/security.md.")
    _add_config_args(p)
    p.add_argument("--id", dest="validator_id", required=True, metavar="ID",
                   help="validator id (its key must be registered with --role validator)")
    p.add_argument("--key", metavar="FILE", help="its signing key file (default: validators.validator_key, else "
                                                 "<keys_dir>/validators/<ID>.key; $HETERORL_VALIDATOR_KEY wins)")

    p = sub.add_parser("learner", help="run the learner (consume rollouts, DeepSpeed + GEPO, publish weights)",
                       description="One learner process, or learner.num_processes of them: started without a "
                                   "launcher it starts the other ranks itself; under torchrun or the deepspeed "
                                   "launcher each process is the rank they set (RANK, LOCAL_RANK, WORLD_SIZE).")
    _add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR", help="run directory for metrics (default: train.out_dir)")

    p = sub.add_parser("evaluator", help="score published policy versions on the held-out split as they appear",
                       description="Watches Redis for new policy versions of the run, scores every "
                                   "eval.every-th (and the last) on the held-out split, appends the results "
                                   "to RUN_DIR/metrics.jsonl, and exits after the last version.")
    _add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR", help="run directory whose metrics.jsonl gets the records")

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
                   help=f"base run config: {_config_help()} (default study)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every cell (repeatable)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="local stack directory")
    _keep_checkpoints_option(p)
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
                   help=f"base run config: {_config_help()} (default seed_regime)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of every cell (repeatable), e.g. learner.max_steps=200")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="local stack directory")
    _keep_checkpoints_option(p)

    p = sub.add_parser("train", help="the main job: local stack + learner + samplers + evaluation + report",
                       description="Starts the local stack unless one is running or URLs are configured, "
                                   "runs one learner and train.num_samplers samplers as separate processes "
                                   "with live progress, evaluates before and after, writes metrics.jsonl, "
                                   "TensorBoard events, summary.json and a PNG plot, then stops what it started.")
    _add_config_args(p)
    p.add_argument("--out", metavar="RUN_DIR", help="run directory (default: train.out_dir)")
    p.add_argument("--keep-stack", action="store_true",
                   help="leave the local stack running afterwards (with its topic, checkpoints and version); "
                        "without it the stack a run started is stopped when no other run uses it")

    p = sub.add_parser("replay", help="train a fresh learner on a recorded rollout topic (offline ablations)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Trains from --base on the groups recorded in --source, with no sampler. "
                                   "Each group keeps the staleness the original learner recorded in its update "
                                   "log, and the replay's own learner.* rules judge it again. Writes "
                                   "metrics.jsonl, TensorBoard events, updates.jsonl, checkpoints and "
                                   "summary.json (with final_checkpoint) into --out; with eval.every set, the "
                                   "same held-out accuracy records as a training run.",
                       epilog="Pass the original run's config (RUN_DIR/config.yaml) to replay it as it was; with "
                              "--exact-batches and the same loss it reproduces the original weights.")
    _add_config_args(p)
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

    p = sub.add_parser("export", help="write a rollout topic and its update log to one Parquet file",
                       description="Reads every message of --topic (and <run>.updates, if present) from the "
                                   "configured or local-stack broker and writes them to --out; docs/schema.md "
                                   "lists the columns. `heterorl replay --source FILE.parquet` trains on it.")
    _add_config_args(p)
    p.add_argument("--topic", required=True, help="rollout topic, e.g. demo.rollouts")
    p.add_argument("--out", required=True, metavar="FILE.parquet", help="Parquet file to write")
    p.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka to read from (default: configured or local stack)")

    p = sub.add_parser("chaos", help="train through seeded faults, then audit that no rollout was lost or reused",
                       description="Starts a durable local stack in OUT/data behind a TCP fault proxy, a learner "
                                   "and N samplers; on a seeded schedule kills and restarts samplers, adds and "
                                   "removes them, kills and restarts the learner once, restarts the broker once and "
                                   "cuts the samplers off from everything for --partition-s seconds, with latency, "
                                   "jitter and connection resets on the samplers' links throughout. Then stops the "
                                   "samplers, drains the learner and writes OUT/audit.json. Exit status 1 if a "
                                   "rollout was lost or used twice.")
    _add_config_args(p)
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

    p = sub.add_parser("loadtest", help="how far one learner, Redis and broker scale: simulated samplers on modeled "
                                        "hardware, async against lock-step",
                       description="Starts a local stack in OUT/data and, for each fleet size, the product's learner "
                                   "(its optimizer step and model-sized checks modeled by their time) and N simulated "
                                   "samplers (the product's sampler code; generation modeled by each sampler's "
                                   "tokens/s from the fleet profile), each behind its own fault-proxy link. Measures "
                                   "loadtest.measure_s seconds per row, audits every group, then runs the lock-step "
                                   "baseline on the same fleets. Writes OUT/loadtest.json and OUT/loadtest.png "
                                   "(docs/loadtest.md). Exit status 1 if a group was lost or used twice.")
    _add_config_args(p)
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

    p = sub.add_parser("weights", help="published policy weights: take any version home as a plain model directory")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = actions.add_parser("fetch", help="rebuild a published version (keyframe or delta) into a Hugging Face directory",
                           description="Downloads the version's keyframe and deltas (or its full copy), rebuilds the "
                                       "weights, checks every tensor bit for bit against the sha256 its manifest "
                                       "names (signed by the learner when security.require_signatures), and writes "
                                       "a directory that transformers loads. Nothing is written unless it verifies.")
    _add_config_args(p)
    p.add_argument("url", metavar="s3://BUCKET/RUN/vN/", help="the version, as `heterorl train` prints it")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (replaced if it exists)")

    p = sub.add_parser("compare", help="side-by-side table and accuracy plot of run directories",
                       description="Prints final and best held-out accuracy, mean KL, importance-weight "
                                   "variance and groups used/dropped of each run (train or replay), and "
                                   "plots their curves on one PNG.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (with metrics.jsonl)")
    p.add_argument("--out", default="compare.png", metavar="FILE.png", help="plot to write (default compare.png)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    return parser


def _cmd_up(args) -> int:
    from infra.local_stack import load_stack, start_stack

    existing = load_stack(args.data_dir)
    if existing is not None:
        print(f"local stack already running in {args.data_dir}/ (kafka {existing.kafka_bootstrap}, "
              f"redis {strip_password(existing.redis_url)}, s3 {existing.s3_endpoint})")
        return 0
    state = start_stack(args.data_dir, kafka_port=args.kafka_port, redis_port=args.redis_port, s3_port=args.s3_port,
                        external_kafka=args.external_kafka)
    print(f"local stack up in {args.data_dir}/: kafka {state.kafka_bootstrap}, redis {strip_password(state.redis_url)}, "
          f"s3 {state.s3_endpoint} (bucket {state.bucket})")
    print(f'point tools at it with: eval "$(heterorl env --data-dir {args.data_dir})"')
    return 0


def _cmd_down(args) -> int:
    from infra.local_stack import stop_stack

    stopped = stop_stack(args.data_dir, wipe=args.wipe)
    print(f"stopped {', '.join(stopped)}" if stopped else f"no local stack running in {args.data_dir}/")
    if args.wipe:
        print(f"deleted the stored data in {args.data_dir}/")
    return 0


def _cmd_env(args) -> int:
    from infra.local_stack import load_stack, stack_env
    from pipeline.servers.services import ServiceUnavailable

    state = load_stack(args.data_dir)
    if state is None:
        raise ServiceUnavailable(f"no local stack running in {args.data_dir}/: run `heterorl up` first")
    for key, value in stack_env(state).items():
        print(f"export {key}={value}")
    return 0


def _cmd_status(args) -> int:
    from heterorl.status import collect_status, format_status

    status = collect_status(args.data_dir, args.run)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def _cmd_keys(args) -> int:
    from heterorl import keys

    if args.action == "init":
        lines = keys.keys_init(_load(args, local_stack=False))
    elif args.action == "add":
        lines = keys.keys_add(_load(args), args.sampler_id, public_key=args.public_key,
                              out=Path(args.out) if args.out else None, lifetime_days=args.days, role=args.role)
    elif args.action == "revoke":
        lines = keys.keys_revoke(_load(args), args.name)
    else:
        lines = keys.keys_list(_load(args))
    print("\n".join(lines))
    return 0


def _cmd_attack(args) -> int:
    cfg = _load(args, local_stack=False)
    from heterorl.attack import run_attack

    return run_attack(cfg, Path(args.out), args.minutes, args.samplers, args.validators)


def _cmd_adversary(args) -> int:
    cfg = _load(args, role="sampler")
    from heterorl.adversaries import run_adversary

    return run_adversary(args.kind, cfg, args.sampler_id)


def _cmd_sampler(args) -> int:
    if args.key:
        args.overrides.append(f"security.sampler_key={args.key}")
    cfg = _load(args, role="sampler")
    from producers.sampler import run_sampler

    return run_sampler(cfg, sampler_id=args.sampler_id)


def _cmd_validator(args) -> int:
    if args.key:
        args.overrides.append(f"validators.validator_key={args.key}")
    cfg = _load(args, role="validator")
    from consumers.validator import run_validator

    return run_validator(cfg, args.validator_id)


def _cmd_learner(args) -> int:
    cfg = _load(args, role="learner")
    from consumers.learner import run_learner

    return run_learner(cfg, Path(args.out) if args.out else None)


def _cmd_evaluator(args) -> int:
    cfg = _load(args)
    from consumers.evaluator import run_evaluator

    return run_evaluator(cfg, Path(args.out) if args.out else None)


def _comma_list(text: str, kind=str) -> list:
    try:
        return [kind(x.strip()) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ConfigError(f"--max-delays and --seeds take comma-separated integers ({e})") from None


def _cmd_study(args) -> int:
    from heterorl.study import QUICK, quick_max_delays, run_delay_study

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
    from heterorl.lr_pilot import run_lr_pilot

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


def _cmd_replay(args) -> int:
    if args.loss:
        args.overrides.append(f"learner.loss_type={args.loss}")
    cfg = _load(args)
    from consumers.replay import ReplayFilter, parse_time, run_replay
    from pipeline.servers.services import require_services

    source = args.source
    if source.startswith("kafka:///"):
        source = f"kafka://{require_services(cfg.services).kafka_bootstrap}/{source[len('kafka:///'):]}"
    flt = ReplayFilter(parse_time(args.from_time), parse_time(args.to_time), args.from_version, args.to_version)
    summary = run_replay(cfg, source, args.base, Path(args.out), exact_batches=args.exact_batches, flt=flt,
                         checkpoints=args.checkpoints)
    print(f"replay {args.out}: {summary['final_policy_version']} steps with {summary['loss_type']}, "
          f"{summary['groups_used']} groups used / {summary['groups_dropped']} dropped, "
          f"final checkpoint {summary['final_checkpoint']}")
    return 0


def _cmd_export(args) -> int:
    from pipeline.records.archive import export_topic
    from pipeline.servers.services import require_services

    bootstrap = args.bootstrap or require_services(_load(args).services).kafka_bootstrap
    summary = export_topic(bootstrap, args.topic, Path(args.out))
    print(f"wrote {summary.path}: {summary.messages} messages, {summary.steps} update-log steps")
    return 0


def _cmd_chaos(args) -> int:
    cfg = _load(args, local_stack=False)
    from heterorl.chaos import run_chaos

    return run_chaos(cfg, Path(args.out), args.minutes, args.samplers, args.partition_s,
                     keep_stack=args.keep_stack, validators=args.validators)


def _sampler_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sampler counts like 1,4,16, got {text!r}") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected sampler counts >= 1 like 1,4,16, got {text!r}")
    return counts


def _cmd_loadtest(args) -> int:
    args.config = args.config or "loadtest"
    cfg = _load(args, local_stack=False)
    from heterorl.loadtest.rig import run_loadtest

    return run_loadtest(cfg, Path(args.out), args.samplers, compare=not args.no_compare, keep_stack=args.keep_stack,
                        validators=args.validators)


def _cmd_weights(args) -> int:
    cfg = _load(args)
    from pipeline.servers.checkpoints import connect_s3
    from pipeline.trust.keyring import key_paths, load_learner_public
    from pipeline.servers.services import require_services
    from pipeline.weights.policy import fetch_published

    trusted = load_learner_public(key_paths(cfg)) if cfg.security.require_signatures else None
    client = connect_s3(require_services(cfg.services), timeout_s=cfg.services.connect_timeout_s)
    path, manifest, report = fetch_published(client, args.url, Path(args.out), trusted=trusted)
    print(f"wrote {path}: policy v{manifest.version} of run {manifest.run}, every tensor verified "
          f"(downloaded {' -> '.join(f'v{v}' for v in report.path)}, {report.bytes_downloaded / 1e6:.1f} MB)")
    return 0


def _cmd_compare(args) -> int:
    from heterorl.compare import compare_runs, format_table, plot_comparison

    dirs = [Path(d) for d in args.run_dirs]
    rows = compare_runs(dirs)
    print(json.dumps(rows, indent=2, default=str) if args.json else format_table(rows))
    print(f"plot: {plot_comparison(dirs, Path(args.out))}", file=sys.stderr)
    return 0


def _cmd_train(args) -> int:
    cfg = _load(args, local_stack=False)  # a config mistake is reported before the heavy imports
    from heterorl.train import run_train

    return run_train(cfg, Path(args.out) if args.out else None,
                     keep_stack=args.keep_stack)


COMMANDS = {"up": _cmd_up, "down": _cmd_down, "env": _cmd_env, "status": _cmd_status,
            "sampler": _cmd_sampler, "validator": _cmd_validator, "learner": _cmd_learner, "evaluator": _cmd_evaluator, "train": _cmd_train,
            "study": _cmd_study, "replay": _cmd_replay, "export": _cmd_export, "compare": _cmd_compare,
            "chaos": _cmd_chaos, "keys": _cmd_keys, "weights": _cmd_weights, "attack": _cmd_attack, "adversary": _cmd_adversary,
            "loadtest": _cmd_loadtest}


SUPERVISORS = ("train", "chaos", "attack", "study", "loadtest")
"""Commands that start processes of their own (each in a session of its own)."""


def _terminated(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in SUPERVISORS:
        # `kill` (SIGTERM) and a closed terminal (SIGHUP) end them like Ctrl-C: they stop the
        # processes and the local stack they started on the way out, instead of leaving them running.
        signal.signal(signal.SIGTERM, _terminated)
        signal.signal(signal.SIGHUP, _terminated)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("heterorl: interrupted", file=sys.stderr)
        return 130
    except (UserError, RunFailed) as e:  # a bug is neither: it keeps its traceback
        print(f"heterorl {args.command}: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, RunFailed) else 2


if __name__ == "__main__":
    sys.exit(main())
