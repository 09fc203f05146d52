"""The publisher's threads (pipeline/weights/publisher.py), without servers: a thread of either
side that dies stops the learner with one line naming why, instead of leaving `take_slot`
waiting forever for a slot nobody hands back; a version handed over as a keyframe is never
skipped."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
import time

import pytest

from pipeline.weights import publisher as pub
from pipeline.weights.publisher import SLOTS, BackgroundPublisher, PublishTarget, SnapshotSlots, TensorPlace

PLACES = [TensorPlace("model.safetensors", "w", "float32", (4,), 0)]


def within(seconds: float, work) -> dict:
    """`work()` on a daemon thread: {"result": ...} or {"error": ...}. Fails the test if it has not
    returned within `seconds` (the daemon thread cannot hang the test run: it is what is tested)."""
    outcome: dict = {}

    def run():
        try:
            outcome["result"] = work()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:.0f}s"
    return outcome


# ---- the learner's side: a fake publisher process ------------------------------------------

FAKE_CHILD = """
import sys
for line in sys.stdin:  # every message gets the reply in argv[1]; the process lives on until told to close
    if '"close"' in line:
        break
    sys.stdout.write(sys.argv[1] + "\\n")
    sys.stdout.flush()
"""


@pytest.fixture
def fake_publisher(monkeypatch, tmp_path):
    """A `BackgroundPublisher` whose process answers each message with a given line (and no store)."""
    made = []
    popen = subprocess.Popen

    def start(reply: str) -> BackgroundPublisher:
        monkeypatch.setattr(pub.subprocess, "Popen",
                            lambda args, **kw: popen([sys.executable, "-c", FAKE_CHILD, reply], **kw))
        target = PublishTarget("{}", "bucket", "run", str(tmp_path), str(tmp_path), "float32", keyframe_every=10,
                               announce=False, recovery=False)
        made.append(BackgroundPublisher(target, PLACES))
        return made[-1]

    yield start
    for publisher in made:
        try:
            publisher.close(timeout_s=5)
        except RuntimeError:
            pass
        if publisher.child.poll() is None:
            publisher.child.kill()
            publisher.child.wait()


@pytest.mark.parametrize("reply, said", [
    ("this is no JSON line", "JSONDecodeError: "),
    (json.dumps({"op": "slot_free"}), "KeyError: 'slot'"),
])
def test_a_reply_reader_that_dies_stops_the_learner_naming_why(fake_publisher, reply, said):
    """A reply the learner cannot read kills its reader thread: slots never come back, and the
    next `take_slot` (or `submit_*`, `check`, `close`) raises naming it, rather than waiting."""
    publisher = fake_publisher(reply)

    def hand_over():  # more versions than slots: one waits for a slot to come back
        for version in range(SLOTS + 1):
            slot = publisher.take_slot()
            publisher.submit_policy(slot, version, {"step": version}, parent_version=None)

    error = within(10, hand_over).get("error")
    assert isinstance(error, RuntimeError), error
    assert re.match(f"^checkpoint publishing failed: the publisher's reply reader died: {re.escape(said)}",
                    str(error)), error
    with pytest.raises(RuntimeError, match="reply reader died"):
        publisher.check()


# ---- the child's side, in this process -----------------------------------------------------

@pytest.fixture
def child(monkeypatch):
    """A publisher process's `_Child` without servers: replies collected, publishing recorded, and
    stdin a pipe the test writes (`child.say`) and keeps open, as a learner still running does."""
    made = pub._Child.__new__(pub._Child)
    made.spec = {"pointer_check_s": 0.1}
    made.jobs, made.cond, made.out_lock = [], threading.Condition(), threading.Lock()
    made.replies, made.run_state, made.pointer, made.published = io.StringIO(), None, None, []
    made.host_copies = None  # no samplers on this host to write copies for
    made.slots = SnapshotSlots(PLACES)

    def publish_policy(job: dict) -> dict:
        made.published.append(job["version"])
        return {"op": "done", "version": job["version"]}

    made.publish_policy = publish_policy
    read_end, write_end = os.pipe()
    learner = os.fdopen(write_end, "w")
    monkeypatch.setattr(sys, "stdin", os.fdopen(read_end, "r"))

    def say(*messages):
        for message in messages:
            learner.write((message if isinstance(message, str) else json.dumps(message)) + "\n")
        learner.flush()

    made.say = say
    made.said = lambda: [json.loads(line) for line in made.replies.getvalue().splitlines()]
    yield made
    learner.close()
    sys.stdin.close()
    made.slots.close()


def policy(slot: int, version: int, keyframe: bool = False) -> dict:
    return {"op": "policy", "slot": slot, "version": version, "extra": {"step": version}, "parent_version": None,
            "keyframe": keyframe}


@pytest.mark.parametrize("line, said", [
    (policy(SLOTS, 0), f"copying slot {SLOTS} failed: IndexError: "),  # a slot it cannot copy out
    ("this is no JSON line", "reading the learner's messages failed: JSONDecodeError: "),
])
def test_a_child_whose_reader_dies_says_why_and_exits_non_zero(child, line, said):
    """The child's reader thread failing is replied as an error at once (the learner raises it
    from `take_slot`), and the child exits with code 1 rather than waiting for jobs forever."""
    child.say(line)
    outcome = within(10, child.run)
    assert outcome == {"result": 1}, outcome
    replies = child.said()
    assert [r["op"] for r in replies] == ["error"] and replies[0]["message"].startswith(said), replies
    assert child.published == []


def test_a_keyframe_waiting_is_never_skipped_while_newer_versions_are(child):
    """Versions arriving faster than they are published (all of them read while the main thread
    has not published any yet): the first, handed over as a keyframe (the base model as v0, or a
    resumed learner's first version), is published; the others still waiting are skipped, in
    order, but the newest."""
    child.say(policy(0, 0, keyframe=True), *(policy(version % SLOTS, version) for version in range(1, 5)),
              {"op": "close"})
    child.read()  # the reader runs ahead of the main thread, which is busy elsewhere
    assert within(10, child.run) == {"result": 0}
    assert child.published == [0, 4]
    skipped = [r["version"] for r in child.said() if r["op"] == "done" and r.get("skipped")]
    assert skipped == [1, 2, 3]
    assert [r["slot"] for r in child.said() if r["op"] == "slot_free"] == [0, 1, 0, 1, 0]


def test_a_recovery_state_in_a_relative_directory_reaches_the_publisher_by_its_absolute_path(
        fake_publisher, tmp_path, monkeypatch):
    """`heterorl learner --out runs/x` from another directory than the publisher process's (the
    repository root) uploaded empty recovery states, and resuming from them failed: the directory
    the learner wrote is the one the publisher is told, whatever the two processes' directories."""
    publisher = fake_publisher(json.dumps({"op": "done"}))
    sent = []
    monkeypatch.setattr(publisher, "_write", sent.append)
    monkeypatch.chdir(tmp_path)

    class Capture:
        def write(self, directory):
            directory.mkdir(parents=True)
            (directory / "model.safetensors").write_bytes(b"weights")

    publisher.submit_state(4, Capture(), pub.Path("runs/x/s4"), {"step": 4})
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent and sent[0]["directory"] == str(tmp_path / "runs" / "x" / "s4")
    assert (pub.Path(sent[0]["directory"]) / "model.safetensors").read_bytes() == b"weights"
