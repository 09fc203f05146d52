"""The processes of a run (`train`, `chaos`): each started as `python -m heterorl ROLE ...`
with its own log in RUN_DIR/logs/, and stopped on every exit path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from pipeline.clients.services import Services, services_env


class RunFailed(RuntimeError):
    """A process of the run failed or the run ran out of time; the message ends with the last
    lines of the log that says why (the traceback, if any, is in that log)."""


LAUNCHER_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What `torchrun` or `deepspeed` set for the process they launch. A role started by a
command of ours is not such a process: the learner starts its own ranks
(`learner.num_processes`), so these are not passed down."""


def child_env(services: Services, **extra: str) -> dict:
    """The environment of a role process: this one's, pointed at `services`, without a
    launcher's rank variables."""
    inherited = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**inherited, **services_env(services), "PYTHONUNBUFFERED": "1", **extra}


def run_supervisor(cmd: list[str], env: Optional[dict] = None, grace_s: float = 120.0) -> int:
    """Run `cmd` (a command that starts processes of its own, like `heterorl train`) to its
    end and return its exit status. It runs in a session of its own, so a Ctrl-C reaches
    only this process; if this process is interrupted (Ctrl-C, or SIGTERM via the commands'
    handler), the child gets one SIGTERM and `grace_s` to stop its processes and local stack,
    and only then (or at a second interrupt) SIGKILL. Killing it at once would leave its
    learner and samplers running; a SIGKILL still does (they run in sessions of their own)."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except BaseException:  # out of time, or interrupted again while waiting
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        raise


IDLE = "idle"
"""A process priority (`Processes.start`): run only when no other process wants the CPU."""


AUTOGROUP = Path("/proc/self/autogroup")
"""Linux's autogroup of this process's session: with `kernel.sched_autogroup_enabled` (the default
of most distributions), the scheduler first shares the CPU between sessions' groups, equally, and
only then between the processes inside a group by their nice values. A child started in a session
of its own is alone in a new group, so its nice value (or SCHED_IDLE) alone would rank it against
nothing: the group's own nice, written here, is what ranks it against the learner's group."""


def _lower_priority(nice: int | str):
    """What a child runs before its command (in its new session) to take a lower CPU priority, the
    process's and its session's autogroup's (`AUTOGROUP`; SCHED_IDLE: the lowest, 19); None: as
    this one's."""
    if not nice:
        return None

    def lower() -> None:
        if nice == IDLE:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        else:
            os.nice(nice)
        try:
            AUTOGROUP.write_text(str(19 if nice == IDLE else min(19, nice)))
        except OSError:  # no autogroups here (a kernel without them): the process's priority is all there is
            pass
    return lower


class Processes:
    """The child processes of a run: started with their own logs, stopped on every exit path."""

    def __init__(self, run_dir: Path, env: dict):
        self.run_dir = run_dir
        self.env = env
        self.procs: dict[str, subprocess.Popen] = {}
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], env: Optional[dict] = None, nice: int | str = 0,
              prefix: tuple[str, ...] = ()) -> None:
        """Start `heterorl ARGS...` as `name`, logging to RUN_DIR/logs/NAME.log, in a session of its
        own, `nice` steps below this process's CPU priority, or (`IDLE`) only when no other
        process wants the CPU (Linux SCHED_IDLE); every thread it starts inherits that. `prefix`:
        a command that runs it (`ip netns exec NS`: on a host of its own), execing it in place."""
        log = open(self.run_dir / "logs" / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([*prefix, sys.executable, "-m", "heterorl", *args], stdout=log,
                                            stderr=subprocess.STDOUT, env=env or self.env, start_new_session=True,
                                            preexec_fn=_lower_priority(nice))
        log.close()

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def stop(self, names: Optional[list[str]] = None, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL whatever is still running after `grace_s`."""
        targets = [n for n in (names or list(self.procs)) if self.alive(n)]
        for n in targets:
            self.procs[n].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for n in targets:
            try:
                self.procs[n].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill(n)

    def kill(self, name: str) -> None:
        """SIGKILL the process and everything it started (a crash, as far as it can tell)."""
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def log_tail(self, name: str, lines: int = 5) -> str:
        text = (self.run_dir / "logs" / f"{name}.log").read_text(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def failure(self, name: str, what: str) -> RunFailed:
        """A RunFailed saying `what` happened to `name`, with the last lines of its log."""
        return RunFailed(f"{what}; last lines of {self.run_dir}/logs/{name}.log:\n{self.log_tail(name)}")
