"""The bookkeeping of one optimizer step, the same for the learner and for replay, and the
learner's two logs on Kafka (`LearnerLogs`: the update log and the dead letters).

After each step: the update-log entry (which groups the step used, which were dropped,
dead-lettered or ignored since the previous step) goes to `RUN_DIR/updates.jsonl` (and,
for the learner, first to Kafka: the log must hold a step before anything builds on
it), and one `{"kind": "learner"}` metrics record to `RUN_DIR/metrics.jsonl` and
TensorBoard. The counts come from the `Admission` that judged the groups.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from pipeline.learning.admission import Admission, PendingGroup
from pipeline.records.metrics import MetricsWriter
from pipeline.records.dead_letters import DeadLetter
from pipeline.records.update_log import UpdateEntry, append_entry, dead_letter_topic, updates_topic
from pipeline.clients.topics import RawRecord, TopicWriter
from pipeline.wire.signing import SigningKey

PROGRESS_KEYS = ("groups_used", "groups_dropped", "groups_reweighted", "groups_consumed", "malformed",
                 "duplicates_ignored")


class StepRecorder:
    """Writes each step's update-log entry and metrics record."""

    def __init__(self, run_dir: Path, metrics: MetricsWriter, admission: Admission, *, loss_type: str, topic: str,
                 vocab_size: int, tokenizer_sha: Optional[str], attempt: str = "",
                 publish: Optional[Callable[[UpdateEntry], None]] = None, signer: Optional[SigningKey] = None,
                 numerics: Optional[dict] = None):
        """`publish`: where else the entry goes before the file (the learner's Kafka update log);
        `signer`: the key that signs the file's entries (the learner's); `numerics`: what each
        entry records of the steps' numerics (`pipeline.runtime.learner_numerics`)."""
        self.numerics = numerics
        self.run_dir, self.metrics, self.admission = Path(run_dir), metrics, admission
        self.loss_type, self.topic, self.vocab_size, self.tokenizer_sha = loss_type, topic, vocab_size, tokenizer_sha
        self.attempt, self.publish, self.signer = attempt, publish, signer
        self._consumed_at_last_step = 0
        self._step_started = time.monotonic()

    def record(self, version: int, batch: list[PendingGroup], step_metrics: dict, step: Optional[int] = None) -> dict:
        """Log the step (trained on `batch`) that made policy `version`; `step`: the optimizer step's
        number, when it is not the version (after a learner's rewind, versions skip the numbers
        its lost steps had published); returns the metrics record's values."""
        step = version if step is None else step
        self.admission.count_used(batch)
        verdicts = self.admission.take_verdicts()
        entry = UpdateEntry(step=step, policy_version=version, loss_type=self.loss_type, time=time.time(),
                            used=[g.used() for g in batch], dropped=verdicts.dropped, malformed=verdicts.malformed,
                            duplicates=verdicts.duplicates, vocab_size=self.vocab_size,
                            tokenizer_sha=self.tokenizer_sha, attempt=self.attempt, topic=self.topic,
                            numerics=self.numerics)
        if self.publish is not None:
            self.publish(entry)
        append_entry(self.run_dir, entry, self.signer)
        counters = self.admission.counters
        progress = counters.as_dict()
        staleness = [g.staleness for g in batch]
        elapsed = time.monotonic() - self._step_started
        values = {
            "policy_version": version, **step_metrics,
            "staleness_mean": sum(staleness) / len(staleness), "staleness_max": max(staleness),
            **{k: progress[k] for k in PROGRESS_KEYS},
            "groups_per_s": (counters.groups_consumed - self._consumed_at_last_step) / max(elapsed, 1e-9),
            "step_seconds": elapsed,
        }
        self.metrics.write("learner", step, values)
        self._consumed_at_last_step, self._step_started = counters.groups_consumed, time.monotonic()
        return values


class LearnerLogs:
    """The learner's writes to Kafka: the update log (`<run>.updates`, also RUN_DIR/updates.jsonl)
    and the messages it set aside (`<run>.dead`: a reference to each, with its reason), both signed
    by `signer` (the learner's key; None only where signatures are off), each retried through a
    broker outage for up to `network_retry_s`, saying so each time."""

    def __init__(self, bootstrap: str, topic: str, run_dir: Path, network_retry_s: float, log, security=None,
                 signer: Optional[SigningKey] = None):
        self.topic, self.run_dir, self.network_retry_s, self.log = topic, Path(run_dir), network_retry_s, log
        self.signer = signer
        self.update_log = TopicWriter(bootstrap, updates_topic(topic), security=security)
        self.dead_letters = TopicWriter(bootstrap, dead_letter_topic(topic), security=security)

    def send_entry(self, entry: UpdateEntry) -> None:
        """The update log must hold a step before anything builds on it."""
        self._send(self.update_log, entry.to_json(self.signer).encode(), key=str(entry.step).encode())

    def publish_entry(self, entry: UpdateEntry) -> None:
        """An update-log entry of the learner's own (the rewind marker): Kafka, then the file."""
        self.send_entry(entry)
        append_entry(self.run_dir, entry, self.signer)

    def dead_letter(self, record: RawRecord, reason: str) -> None:
        """Set a message of the rollout topic aside: where it is, its size and hash, and why (never a
        copy, which could fail where the message did not: one too large for this producer)."""
        letter = DeadLetter.of(record, self.topic, reason)
        self._send(self.dead_letters, letter.to_bytes(self.signer), headers=[("reason", reason.encode()[:256])])
        self.log.warning("dead-lettered message at %s[%d]@%d (%d bytes) to %s: %s", self.topic, record.partition,
                         record.offset, letter.size, dead_letter_topic(self.topic), reason)

    def _send(self, sink: TopicWriter, value: bytes, **kwargs) -> None:
        sink.retrying(lambda: sink.send_raw(value, **kwargs), self.network_retry_s, self.log)

    def close(self) -> None:
        self.update_log.close()
        self.dead_letters.close()
