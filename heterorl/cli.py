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
import importlib
import os
import re
import signal
import sys
from importlib import metadata
from pathlib import Path

from heterorl.commands import compare, invites, keys, replay, roles, stack, train, weights
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
"""The commands in the order `heterorl --help` lists them, the lab's among them (attack, adversary, study,
chaos, wan, loadtest: there when the lab is installed); one another package adds comes after them."""

ENTRY_POINTS = "heterorl.commands"
"""The entry-point group through which another package adds commands: each entry is a command's name and
the module whose `COMMANDS` declares it. The lab adds its commands so (pyproject.toml, lab/commands/); the
product never imports the lab."""


def _registered() -> dict[str, str]:
    """Each command added through `ENTRY_POINTS`, and its module. Run from a source tree that is not
    installed (`PYTHONPATH=. python -m heterorl`, as bench/gpu_study.sh does), the tree's pyproject.toml,
    which declares the entries, stands in for the metadata an install would have written."""
    found = {entry.name: entry.value for entry in metadata.entry_points(group=ENTRY_POINTS)}
    try:
        metadata.distribution("heterorl")
    except metadata.PackageNotFoundError:
        source = Path(__file__).resolve().parents[1] / "pyproject.toml"
        if source.is_file():
            import tomllib

            project = tomllib.loads(source.read_text())["project"]
            found = {**project.get("entry-points", {}).get(ENTRY_POINTS, {}), **found}
    return found


def _declare() -> tuple[dict[str, tuple], dict[str, str]]:
    """Each command there is (its options' function and its own), and where each one missing would come from:
    the module an entry names but this installation lacks, or the lab for one of `ORDER`'s."""
    declared = {name: entry for module in (stack, keys, invites, roles, train, replay, weights, compare)
                for name, entry in module.COMMANDS.items()}
    missing = dict.fromkeys(ORDER, "the lab (lab/)")
    for name, module_name in _registered().items():
        try:
            declared[name] = importlib.import_module(module_name).COMMANDS[name]
        except ModuleNotFoundError as e:  # the module itself or its package absent; anything else is a bug
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise
            missing[name] = f"{module_name.split('.')[0]}/ ({module_name})"
    return declared, {name: source for name, source in missing.items() if name not in declared}


def _not_installed(name: str, source: str) -> tuple:
    """A command this installation lacks: not listed, and one line (exit status 2) if a user types it."""
    def register(sub) -> None:
        sub.add_parser(name, add_help=False)

    def run(args) -> int:
        raise UserError(f"`heterorl {name}` is not installed here: it comes with {source}, which this "
                        "installation lacks (`make install` in a whole checkout has it)")

    return register, run


_DECLARED, _MISSING = _declare()
_DECLARED.update({name: _not_installed(name, source) for name, source in _MISSING.items()})
_NAMES = (*ORDER, *sorted(set(_DECLARED) - set(ORDER)))
COMMANDS = {name: _DECLARED[name][1] for name in _NAMES}
"""Each command's function, by name (declared with its options in heterorl/commands/, or by the package that
added it: lab/commands/)."""


def build_parser() -> argparse.ArgumentParser:
    examples = "".join(line for line in EXAMPLES.splitlines(keepends=True)  # less the commands not installed
                       if not (m := re.match(r"\s+heterorl ([a-z]+)", line)) or m.group(1) not in _MISSING)
    parser = argparse.ArgumentParser(
        prog="heterorl", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=examples,
        description="Asynchronous RL post-training over an unreliable WAN: samplers publish "
                    "version-tagged rollouts to Kafka, a DeepSpeed learner trains with GEPO and "
                    "publishes weights to S3, Redis holds the current policy version.")
    # The deepspeed launcher puts --local_rank=N right after the module name (unless given
    # --no_local_rank); the LOCAL_RANK it also sets is what the learner reads.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in _NAMES:
        _DECLARED[name][0](sub)
    return parser


SUPERVISORS = ("train", "chaos", "wan", "attack", "study", "loadtest")
"""Commands that start processes of their own (each in a session of its own)."""


def _terminated(*_) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command not in _MISSING:  # what parse_args does; a command not installed says so instead
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
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
