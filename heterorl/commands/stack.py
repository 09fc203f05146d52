"""The local stack: `up`, `down`, `status`, `env`."""

from __future__ import annotations

import json
import shlex

from heterorl.commands.common import DEFAULT_DATA_DIR
from pipeline.config import strip_password


def register_up(sub) -> None:
    p = sub.add_parser("up", help="start the local stack (Kafka-API broker, Redis, S3) on loopback or --host",
                       description="Start real servers on 127.0.0.1 (or --host) and record them in DIR/stack.json. "
                                   "Every other command uses this stack unless service URLs are configured. "
                                   "With --host, roles on other machines use it through the variables "
                                   "`heterorl env --role ROLE` prints (docs/deployment.md).")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR",
                   help=f"where server data, logs and the state file live (default {DEFAULT_DATA_DIR})")
    p.add_argument("--kafka-port", type=int, default=0, help="broker port (default: a free port)")
    p.add_argument("--redis-port", type=int, default=0, help="Redis port (default: a free port)")
    p.add_argument("--s3-port", type=int, default=0, help="S3 port (default: a free port)")
    p.add_argument("--external-kafka", metavar="HOST:PORT",
                   help="use this existing Kafka instead of starting a broker")
    p.add_argument("--host", default="127.0.0.1", metavar="ADDR",
                   help="the address the servers listen on and the URLs name (default 127.0.0.1; another machine's "
                        "address serves roles on other machines: Redis and S3 check every login, the broker does "
                        "not, so keep it on a network you control)")


def _cmd_up(args) -> int:
    from infra.local_stack import load_stack, start_stack

    existing = load_stack(args.data_dir)
    if existing is not None:
        print(f"local stack already running in {args.data_dir}/ (kafka {existing.kafka_bootstrap}, "
              f"redis {strip_password(existing.redis_url)}, s3 {existing.s3_endpoint})")
        return 0
    state = start_stack(args.data_dir, kafka_port=args.kafka_port, redis_port=args.redis_port, s3_port=args.s3_port,
                        external_kafka=args.external_kafka, host=args.host)
    print(f"local stack up in {args.data_dir}/: kafka {state.kafka_bootstrap}, redis {strip_password(state.redis_url)}, "
          f"s3 {state.s3_endpoint} (bucket {state.bucket})")
    print(f'point tools at it with: eval "$(heterorl env --data-dir {args.data_dir})"')
    return 0


def register_down(sub) -> None:
    p = sub.add_parser("down", help="stop the servers that `heterorl up` started (data is kept)",
                       description="Stops the recorded servers. Topics, checkpoints and Redis stay in DIR and "
                                   "are served again by the next `heterorl up`, unless --wipe.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")
    p.add_argument("--wipe", action="store_true",
                   help="also delete the stored topics, checkpoints and Redis data (logs are kept)")


def _cmd_down(args) -> int:
    from infra.local_stack import stop_stack

    stopped = stop_stack(args.data_dir, wipe=args.wipe)
    print(f"stopped {', '.join(stopped)}" if stopped else f"no local stack running in {args.data_dir}/")
    if args.wipe:
        print(f"deleted the stored data in {args.data_dir}/")
    return 0


def register_status(sub) -> None:
    p = sub.add_parser("status", help="servers, policy version, checkpoints and live samplers",
                       description="Prints where the servers are and the state of one run. Never prints secrets.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")
    p.add_argument("--run", metavar="NAME", help="run to describe (default: the most recently started run)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _cmd_status(args) -> int:
    from heterorl.status import collect_status, format_status

    status = collect_status(args.data_dir, args.run)
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def register_env(sub) -> None:
    p = sub.add_parser("env", help="print `export` lines for the running local stack",
                       description='Use as: eval "$(heterorl env)" — then redis-cli, the aws CLI, boto3, '
                                   "kafka-python and confluent-kafka (librdkafka 2.2 or newer) talk to the local "
                                   "servers. kcat built on librdkafka older than 2.2 cannot talk to the local broker.")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, metavar="DIR", help="stack directory")
    p.add_argument("--role", choices=("admin", "learner", "sampler", "validator"), default="admin",
                   help="whose Redis user the lines carry (default admin: every command; give a learner, sampler "
                        "or validator on another machine its own role's lines)")


def _cmd_env(args) -> int:
    from infra.local_stack import load_stack, stack_env
    from pipeline.clients.services import ServiceUnavailable

    state = load_stack(args.data_dir)
    if state is None:
        raise ServiceUnavailable(f"no local stack running in {args.data_dir}/: run `heterorl up` first")
    for key, value in stack_env(state, args.role).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


COMMANDS = {"up": (register_up, _cmd_up), "down": (register_down, _cmd_down), "status": (register_status, _cmd_status), "env": (register_env, _cmd_env)}
