"""A supervising command run by another (a study's cells) is stopped, not killed, on an interrupt."""

import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from heterorl.processes import run_supervisor

CHILD = textwrap.dedent("""
    import signal, subprocess, sys, time
    # Like `heterorl train`: it starts a process of its own, in a session of its own.
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    open(sys.argv[1] + ".worker", "w").write(str(worker.pid))
    def stop(*_):
        if sys.argv[2] == "cleans-up":
            worker.terminate(); worker.wait()
            open(sys.argv[1], "w").write("stopped its worker")
            sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    time.sleep(60)
""")


def _interrupt_soon(path):
    def fire():
        while not os.path.exists(path):  # once the child has started its worker
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=fire, daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"


@pytest.fixture
def ctrl_c_interrupts():
    """Ctrl-C raises KeyboardInterrupt, as in a command's process. An in-process sampler of an
    earlier test (its StopRequest) may have replaced that handler in this one."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupted(tmp_path, mode: str, grace_s: float):
    """run_supervisor on CHILD, interrupted once the child has started its worker: (marker, seconds)."""
    marker = tmp_path / "marker"
    _interrupt_soon(f"{marker}.worker")
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        run_supervisor([sys.executable, "-c", CHILD, str(marker), mode], grace_s=grace_s)
    return marker, time.monotonic() - started


def test_an_interrupted_supervisor_gets_sigterm_and_stops_its_own_processes(tmp_path, ctrl_c_interrupts):
    marker, seconds = _interrupted(tmp_path, "cleans-up", grace_s=30)
    assert marker.read_text() == "stopped its worker" and seconds < 30
    assert not _alive(int((tmp_path / "marker.worker").read_text()))


def test_a_supervisor_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path, ctrl_c_interrupts):
    marker, seconds = _interrupted(tmp_path, "ignores", grace_s=1)
    assert 1 <= seconds < 20 and not marker.exists()
    os.kill(int((tmp_path / "marker.worker").read_text()), signal.SIGKILL)  # its own session: not ours to reap


def test_the_exit_status_comes_back():
    assert run_supervisor([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3


def test_train_gives_each_role_its_share_of_the_cores():
    from heterorl.processes import IDLE
    from heterorl.train import EVALUATOR_NICE, SAMPLER_NICE, cpu_budgets
    from pipeline.config import load_config

    def budgets(sharing, **more):
        sets = [f"train.cpu_sharing={sharing}", "train.num_samplers=2", "sampler.torch_threads=1",
                "eval.torch_threads=1", "learner.torch_threads=3"] + [f"{k}={v}" for k, v in more.items()]
        return cpu_budgets(load_config(None, sets, env={}), cores=8)

    # yield: every role may use every core; samplers pause while the learner is busy, the
    # evaluator runs in what both leave idle.
    assert budgets("yield") == {"learner": (8, 0), "sampler": (8, 0), "evaluator": (8, IDLE)}
    # priority: every role may use every core; the scheduler serves the learner first.
    assert budgets("priority") == {"learner": (8, 0), "sampler": (8, SAMPLER_NICE), "evaluator": (8, EVALUATOR_NICE)}
    assert 0 < SAMPLER_NICE < EVALUATOR_NICE
    # split: the samplers' threads, the learner the rest (never none), the evaluator in the background.
    assert budgets("split") == {"learner": (6, 0), "sampler": (1, 0), "evaluator": (1, EVALUATOR_NICE)}
    assert budgets("split", **{"train.num_samplers": 8})["learner"] == (1, 0)
    # none: as configured; and on a GPU, whatever the policy.
    assert budgets("none") == {"learner": (3, 0), "sampler": (1, 0), "evaluator": (1, 0)}
    from pipeline.config import load_config as load
    on_gpu = cpu_budgets(load(None, ["train.cpu_sharing=yield", "learner.torch_threads=3"], env={}), 8, on_gpu=True)
    assert on_gpu == {"learner": (3, 0), "sampler": (1, 0), "evaluator": (1, 0)}


def test_a_role_process_starts_at_the_priority_it_is_given(tmp_path, monkeypatch):
    from heterorl.processes import AUTOGROUP, IDLE, Processes

    stand_in = tmp_path / "python"
    stand_in.write_text("#!/bin/sh\nexec sleep 30\n")  # any role: it runs long enough to be looked at
    stand_in.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(stand_in))
    procs = Processes(tmp_path, dict(os.environ))
    procs.start("niced", ["sampler"], nice=7)
    procs.start("plain", ["learner"])
    procs.start("idle", ["evaluator"], nice=IDLE)
    try:
        own = os.getpriority(os.PRIO_PROCESS, 0)
        assert os.getpriority(os.PRIO_PROCESS, procs.procs["niced"].pid) == min(19, own + 7)
        assert os.getpriority(os.PRIO_PROCESS, procs.procs["plain"].pid) == own
        assert os.sched_getscheduler(procs.procs["idle"].pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(procs.procs["plain"].pid) == os.sched_getscheduler(0)
        # Each is alone in its session's autogroup, where the kernel has them: the group's nice is
        # what ranks it against the other roles' groups (a process's own nice ranks it inside only)
        if AUTOGROUP.exists() and Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1":
            def group_nice(name: str) -> int:
                return int(Path(f"/proc/{procs.procs[name].pid}/autogroup").read_text().split("nice")[1])
            assert (group_nice("niced"), group_nice("idle"), group_nice("plain")) == (7, 19, 0)
    finally:
        procs.stop(grace_s=1)


def test_samplers_that_yield_to_the_learner_also_wait_for_its_next_version():
    from heterorl.train import cpu_budgets, roles_config
    from pipeline.config import load_config

    def roles(*sets, yields=True):
        cfg = load_config(None, list(sets), env={})
        return roles_config(cfg, cpu_budgets(cfg, cores=2), yields)

    shared = roles("train.cpu_sharing=yield")
    assert shared.sampler.yield_to_learner and shared.sampler.wait_for_next_version and shared.eval.after_training
    assert shared.sampler.torch_threads == shared.learner.torch_threads == 2
    # not every version published: yielding still, but no waiting for versions that never come
    sparse = roles("train.cpu_sharing=yield", "learner.sync_every=2")
    assert sparse.sampler.yield_to_learner and not sparse.sampler.wait_for_next_version
    load_config(None, [f"sampler.wait_for_next_version={sparse.sampler.wait_for_next_version}",
                       "learner.sync_every=2"], env={})  # what the roles load is valid
    # a simulated refresh delay makes groups stale on purpose (the delay study): no waiting
    delayed = roles("train.cpu_sharing=yield", "sampler.delays.refresh.kind=fixed", "sampler.delays.refresh.value=2")
    assert delayed.sampler.yield_to_learner and not delayed.sampler.wait_for_next_version
    # on a GPU, or another policy: samplers generate ahead of the learner
    ahead = roles("train.cpu_sharing=priority", yields=False)
    assert not (ahead.sampler.yield_to_learner or ahead.sampler.wait_for_next_version or ahead.eval.after_training)


def test_the_fast_start_evaluates_the_base_model_where_it_takes_no_cores_from_the_roles(tmp_path):
    from heterorl.train import base_evaluation_when, cpu_budgets, roles_config
    from pipeline.config import load_config

    def cfg(*sets):
        return load_config(None, list(sets), env={})

    assert base_evaluation_when(cfg("train.fast_start=false"), on_gpu=True) == "first"
    assert base_evaluation_when(cfg(), on_gpu=True) == "beside"  # start-up on a GPU is mostly waiting
    assert base_evaluation_when(cfg("train.cpu_sharing=none"), on_gpu=False) == "beside"
    for sharing in ("yield", "priority", "split"):  # the roles take every core of the CPU
        assert base_evaluation_when(cfg(f"train.cpu_sharing={sharing}"), on_gpu=False) == "after"
    # the roles' config names the base model's digest and the shared-memory directory to both sides
    base = cfg()
    roles = roles_config(base, cpu_budgets(base, cores=2), True, "ab" * 32, tmp_path / "shm")
    assert roles.sampler.local_v0_sha256 == "ab" * 32
    assert roles.sampler.host_copies_dir == roles.learner.host_copies_dir == str(tmp_path / "shm")
    plain = roles_config(base, cpu_budgets(base, cores=2), True)
    assert plain.sampler.local_v0_sha256 is None and plain.sampler.host_copies_dir is None
    load_config(None, [f"sampler.local_v0_sha256={'ab' * 32}"], env={})  # what the roles load is valid
    from pipeline.config.base import ConfigError

    with pytest.raises(ConfigError, match=r"sampler\.local_v0_sha256"):
        load_config(None, ["sampler.local_v0_sha256=not-a-digest"], env={})
