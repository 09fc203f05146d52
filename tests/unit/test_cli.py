"""The command line as users meet it: instant help, one-line errors, never a traceback."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def heterorl(*args, env=None, timeout=60):
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("KAFKA_BOOTSTRAP_SERVERS", "REDIS_URL", "AWS_ENDPOINT_URL")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "heterorl", *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    out = heterorl("--help").stdout
    for command in ("up", "down", "status", "env", "sampler", "learner", "evaluator", "train", "study", "replay",
                    "export", "compare", "chaos", "wan"):
        assert command in out


def test_every_option_of_every_command_has_help_text():
    import argparse

    from heterorl.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(commands.choices) == {"up", "down", "status", "env", "sampler", "learner", "evaluator", "train",
                                     "study", "replay", "export", "compare", "chaos", "keys", "invite", "join", "attack", "adversary",
                                     "validator", "weights", "loadtest", "wan"}
    studies = next(a for a in commands.choices["study"]._actions if isinstance(a, argparse._SubParsersAction))
    actions = next(a for a in commands.choices["keys"]._actions if isinstance(a, argparse._SubParsersAction))
    weights = next(a for a in commands.choices["weights"]._actions if isinstance(a, argparse._SubParsersAction))
    parsers = {**commands.choices, **{f"study {k}": v for k, v in studies.choices.items()},
               **{f"keys {k}": v for k, v in actions.choices.items()},
               **{f"weights {k}": v for k, v in weights.choices.items()}}
    for name, sub in parsers.items():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"heterorl {name} {action.option_strings[0]} has no help text"
    assert heterorl("train", "--help").stdout.startswith("usage: heterorl train")


def test_every_example_in_the_help_is_a_command_line_the_cli_accepts():
    """The examples `heterorl --help` ends with parse as they are printed, and the runs they
    name (topics, S3 prefixes) have the name `heterorl train` gives a run: run.name-YYYYmmdd-HHMMSS."""
    import re
    import shlex

    from heterorl.cli import EXAMPLES, build_parser

    parser = build_parser()
    variables, parsed = {}, 0
    for line in EXAMPLES.splitlines()[1:]:
        for part in line.split(" #", 1)[0].split("&&"):
            words = shlex.split(part)
            if len(words) == 1 and re.fullmatch(r"[A-Z]+=\S+", words[0]):  # a variable the lines below use
                name, value = words[0].split("=", 1)
                variables[name] = value
            elif words and words[0] == "heterorl":
                words = [re.sub(r"\$([A-Z]+)", lambda m: variables[m.group(1)], w) for w in words]
                args = parser.parse_args(words[1:])
                parsed += 1
                for value in (getattr(args, field, None) for field in ("source", "base", "topic", "url")):
                    if value:
                        run = re.search(r"(?:kafka:///|s3://[^/]+/)?([^/]+?)(?:\.rollouts|/v\d+/)", value).group(1)
                        assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*-\d{8}-\d{6}", run), line
    assert parsed >= 15


def test_unreachable_service_is_named_in_one_line(tmp_path):
    proc = heterorl("learner", "--config", "smoke", "--data-dir", str(tmp_path),
                    env={"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:2/0",
                         "AWS_ENDPOINT_URL": "http://127.0.0.1:3"})
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "cannot reach Kafka at 127.0.0.1:1" in lines[0]
    assert "Traceback" not in proc.stderr


def test_no_stack_and_no_urls_says_what_to_do(tmp_path):
    proc = heterorl("status", "--data-dir", str(tmp_path))
    assert proc.returncode == 2
    assert "run `heterorl up`" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_bad_config_field_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  loss_type: gepoo\n")
    proc = heterorl("learner", "--config", str(bad))
    assert proc.returncode == 2
    assert "learner.loss_type" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_config_file(tmp_path):
    proc = heterorl("sampler", "--config", str(tmp_path / "nope.yaml"))
    assert proc.returncode == 2 and "config file not found" in proc.stderr


def test_built_in_configs_are_found_from_any_directory(tmp_path):
    assert "built-in config (dataset_example, demo, loadtest, long_study, seed_regime, smoke, smollm2, smollm2_plateau, smollm2_study, study)" in " ".join(heterorl("train", "--help").stdout.split())
    env = {"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1", "REDIS_URL": "redis://127.0.0.1:2/0",
           "AWS_ENDPOINT_URL": "http://127.0.0.1:3"}
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--set", "learner.lr=oops"],
                          cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=60)
    smoke = ROOT / "heterorl" / "configs" / "smoke.yaml"
    assert proc.returncode == 2 and f"invalid config {smoke}: learner.lr" in proc.stderr  # the config was found
    proc = subprocess.run([sys.executable, "-m", "heterorl", "train", "--config", "demoo"], cwd=tmp_path,
                          env=full_env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "config file not found: demoo (built-in configs: dataset_example, demo, loadtest, long_study, seed_regime, smoke, smollm2, smollm2_plateau, smollm2_study, study)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bug_keeps_its_traceback_and_a_failed_run_exits_1(monkeypatch, capsys):
    from heterorl import cli
    from heterorl.processes import RunFailed

    def bug(args):
        raise RuntimeError("a bug")

    def failed_run(args):
        raise RunFailed("learner exited with code 1; last lines of runs/x/logs/learner.log:\n...")

    monkeypatch.setitem(cli.COMMANDS, "status", bug)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["status"])
    monkeypatch.setitem(cli.COMMANDS, "status", failed_run)
    assert cli.main(["status"]) == 1
    assert capsys.readouterr().err.startswith("heterorl status: error: learner exited with code 1")


def test_roles_started_by_our_commands_do_not_inherit_a_launchers_rank_variables(monkeypatch):
    """A shell (or a test process) that once ran a learner rank keeps WORLD_SIZE & co.; the
    learner that `heterorl train` starts must still start its own learner.num_processes ranks."""
    from heterorl.processes import child_env
    from pipeline.clients.services import Services

    for name, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_PORT": "29500",
                        "MASTER_ADDR": "127.0.0.1", "SOME_USER_SETTING": "kept"}.items():
        monkeypatch.setenv(name, value)
    env = child_env(Services("127.0.0.1:9092", "redis://127.0.0.1:6379/0", "http://127.0.0.1:9000", "a", "b",
                             "us-east-1", "heterorl"))
    assert not {"WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"} & set(env)
    assert env["SOME_USER_SETTING"] == "kept"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_the_learner_accepts_the_local_rank_argument_of_the_deepspeed_launcher():
    from heterorl.cli import build_parser

    # deepspeed --module heterorl learner ... runs `python -m heterorl --local_rank=N learner ...`
    args = build_parser().parse_args(["--local_rank=1", "learner", "--config", "smoke"])
    assert args.local_rank == 1 and args.config == "smoke"


def test_the_adversary_command_offers_every_kind_the_lab_has():
    from lab.adversaries import ADVERSARY_SAMPLERS, SAMPLER_KINDS
    from lab.commands.audits import ADVERSARY_KINDS

    assert ADVERSARY_KINDS == SAMPLER_KINDS == tuple(ADVERSARY_SAMPLERS)


LAB_COMMANDS = {"attack", "adversary", "study", "chaos", "wan", "loadtest"}


def test_the_lab_adds_its_commands_through_the_entry_points_pyproject_declares(monkeypatch):
    """The CLI finds the lab's commands in the `heterorl.commands` entry points (the product never imports
    the lab); what is installed is what pyproject.toml declares (a stale .venv: `make install`), and a
    source tree that is not installed reads the same from its pyproject.toml."""
    import tomllib
    from importlib import metadata

    from heterorl import cli

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][cli.ENTRY_POINTS]
    installed = {entry.name: entry.value for entry in metadata.entry_points(group=cli.ENTRY_POINTS)}
    assert installed == declared, "the installed entry points are not pyproject.toml's: run `make install`"
    assert set(declared) == LAB_COMMANDS and all(module.startswith("lab.commands.") for module in declared.values())
    assert cli._MISSING == {} and set(cli.COMMANDS) == set(cli.ORDER)

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", not_installed)
    monkeypatch.setattr(metadata, "entry_points", lambda group: [])
    assert cli._registered() == declared
    monkeypatch.setattr(cli, "_registered", lambda: {})  # installed, but nothing adds a command
    assert cli._declare()[1] == dict.fromkeys([name for name in cli.ORDER if name in LAB_COMMANDS], "the lab (lab/)")


def test_without_the_lab_its_commands_are_missing_and_say_so_in_one_line():
    """An installation without lab/ (the Docker image's) lists none of the lab's commands or examples; one
    typed is one line on stderr, exit status 2, as any user mistake is; the product's commands work as ever."""
    program = textwrap.dedent("""
        import sys

        class NoLab:  # an installation without lab/
            def find_spec(self, name, path=None, target=None):
                if name == "lab" or name.startswith("lab."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)

        sys.meta_path.insert(0, NoLab())
        from heterorl import cli
        sys.exit(cli.main(sys.argv[1:]))
    """)

    def without_lab(*args):
        return subprocess.run([sys.executable, "-c", program, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=60)

    help_text = without_lab("--help").stdout
    assert "heterorl train --config demo" in help_text and "compare" in help_text
    for name in LAB_COMMANDS:
        assert f" {name} " not in help_text and f"heterorl {name}" not in help_text, name
    for args in (["study", "delay", "--out", "x", "--quick"], ["chaos", "--help"], ["adversary"]):
        proc = without_lab(*args)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.splitlines() == [f"heterorl {args[0]}: error: `heterorl {args[0]}` is not installed here: it "
                                            f"comes with lab/ (lab.commands.{'study' if args[0] == 'study' else 'audits'})"
                                            ", which this installation lacks (`make install` in a whole checkout has it)"]
    assert without_lab("train", "--help").stdout.startswith("usage: heterorl train")
    proc = without_lab("train", "--bogus")
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == "heterorl: error: unrecognized arguments: --bogus"


def test_a_ctrl_c_after_the_command_finished_leaves_its_status():
    """`heterorl join` at the end of its run: a Ctrl-C that comes while Python tears its modules
    down (where it puts SIGINT back to the default, which killed the process: status -2, as a
    volunteer's join did in CI) leaves with the command's own status and no traceback."""
    program = textwrap.dedent("""
        import sys, time
        from heterorl import cli

        class SlowTeardown:  # a library's object that takes its time to go
            def __del__(self):
                print("tearing down", flush=True)
                time.sleep(3)

        teardown = SlowTeardown()

        def finished(args):
            print("done", flush=True)
            return 0

        cli.COMMANDS["status"] = finished
        sys.argv = ["heterorl", "status"]
        sys.exit(cli.main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "done"
    assert proc.stdout.readline().strip() == "tearing down"
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 0
    assert "Traceback" not in proc.stderr.read()
