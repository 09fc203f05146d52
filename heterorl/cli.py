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
import atexit
import functools
import os
import signal
import sys

from heterorl.commands import audits, compare, invites, keys, loadtest, replay, roles, stack, study, train, weights
from heterorl.processes import RunFailed
from pipeline.errors import UserError

EXAMPLES = """\
examples:
  heterorl train --config demo                       # the whole loop on a local stack
  heterorl up && eval "$(heterorl env)"              # start servers, point redis-cli/aws/kafka-python at them
  heterorl keys init --config demo                   # the root and learner keys (docs/security.md)
  heterorl learner --config demo --out runs/x        # the learner alone, in run `demo` (run.name as is)
  heterorl keys add my-gpu-box --config demo         # a sampler's key, in run demo's registry
  heterorl sampler --config demo --id my-gpu-box     # start as many as you like, anywhere, each with its key
  heterorl invite --config demo --joins 3 --out invite.txt  # one line with which 3 volunteers may join
  heterorl join --invite invite.txt                  # on a volunteer's host: admitted, sampling
  heterorl status --json
  RUN=demo-20261123-040837                           # the name `train` printed: run.name-YYYYmmdd-HHMMSS
  heterorl replay --config runs/$RUN/config.yaml --source kafka:///$RUN.rollouts --base s3://heterorl/$RUN/v0/ --out runs/gspo --loss gspo
  heterorl export --topic $RUN.rollouts --out $RUN.parquet
  heterorl weights fetch s3://heterorl/$RUN/v100/ --out final-model  # a verified HF directory
  heterorl compare runs/$RUN runs/gspo
  heterorl chaos --minutes 15 --samplers 3 --out runs/chaos   # faults + audit.json
  heterorl wan --config smollm2 --compare-unshaped --out runs/wan  # samplers behind shaped links: wan_report
  heterorl loadtest --samplers 1,4,16 --out runs/loadtest   # capacity rig: loadtest.json + PNG
  heterorl attack --config demo --minutes 3 --out runs/attack # adversaries + attack_audit.json
  heterorl down                                      # data is kept; --wipe deletes it
"""


ORDER = ("up", "down", "status", "env", "keys", "invite", "join", "attack", "adversary", "sampler", "validator", "learner", "evaluator",
         "study", "train", "replay", "export", "chaos", "wan", "loadtest", "weights", "compare")
"""The commands in the order `heterorl --help` lists them."""

_DECLARED = {name: entry for module in (stack, keys, invites, audits, roles, study, train, replay, loadtest, weights, compare)
             for name, entry in module.COMMANDS.items()}
COMMANDS = {name: _DECLARED[name][1] for name in ORDER}
"""Each command's function, by name (declared with its options in heterorl/commands/)."""


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
    for name in ORDER:
        _DECLARED[name][0](sub)
    return parser


SUPERVISORS = ("train", "chaos", "wan", "attack", "study", "loadtest")
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
        code = COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("heterorl: interrupted", file=sys.stderr)
        code = 130
    except (UserError, RunFailed) as e:  # a bug is neither: it keeps its traceback
        print(f"heterorl {args.command}: error: {e}", file=sys.stderr)
        code = 1 if isinstance(e, RunFailed) else 2
    if argv is None:  # the program, not a caller in Python: the command is done. A Ctrl-C while
        # the interpreter waits on a library's threads ends the process at once with the command's
        # own status; once it tears its modules down (where Python puts SIGINT back to the default,
        # which kills the process: status -2), a Ctrl-C is ignored.
        signal.signal(signal.SIGINT, functools.partial(_leave_now, code))
        atexit.register(signal.signal, signal.SIGINT, signal.SIG_IGN)
    return code


def _leave_now(code: int, *_) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
