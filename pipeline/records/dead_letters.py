"""Dead letters: the learner's record of each message of the rollout topic it set aside, and why.

A dead letter (`<run>.dead`, one Kafka message each) names the message, it does not copy it:

    {"schema": 2, "source_topic": "demo.rollouts", "partition": 0, "offset": 412,
     "size": 9437184, "sha256": "…", "rollout_id": "ab12…" | null, "sampler_id": "…" | null,
     "reason": "rejected: unsigned", "time": 1763800000.0, "signature": {...}}

Why by reference: a copy can fail where the original did not. A record too large for the
learner's own producer (one of 9 MB, say) stopped the learner for good when it was copied, and
again after every restart, since it read the record again. The rollout topic keeps the message
itself, and (`source_topic`, `partition`, `offset`, `sha256`) find it and prove it is the one.
`rollout_id` and `sampler_id` are what the message's headers said (a sender's claim, kept for
reading the log; the audit identifies messages by them as it does in the rollout topic).

Each dead letter is signed by the learner's key (`pipeline.wire.signing.sign_document`), as the
update log is: the audit (`pipeline.records.audit`) counts only those the learner signed for this
rollout topic, and refuses the rest with their reason (`pipeline.records.update_log.RefusedRecord`),
so a forged dead letter cannot account for a message that was lost.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterable, Optional

from pipeline.clients.topics import RawRecord, read_topic, topic_partitions
from pipeline.records.update_log import (ControlRecordRefused, RefusedRecord, count_reasons, dead_letter_topic,
                                         verified_control_record)
from pipeline.wire.signing import PublicKey, SigningKey, sign_document

DEAD_LETTER_SCHEMA = 2
"""1 was a copy of the message with the reason and source in its headers (before 0.3)."""
HEADER_CHARS = 128
"""At most this many characters of a header a dead letter repeats (the sender chose them)."""


@dataclass(frozen=True)
class DeadLetter:
    source_topic: str
    partition: int
    offset: int
    size: int
    """Bytes of the message's value."""
    sha256: str
    """Of the message's value (hex)."""
    reason: str
    rollout_id: Optional[str] = None
    sampler_id: Optional[str] = None
    time: float = 0.0
    schema: int = DEAD_LETTER_SCHEMA

    @classmethod
    def of(cls, record: RawRecord, source_topic: str, reason: str) -> "DeadLetter":
        value = record.value or b""
        return cls(source_topic, record.partition, record.offset, len(value), hashlib.sha256(value).hexdigest(),
                   reason, _header(record, "rollout_id"), _header(record, "sampler_id"), time.time())

    def to_bytes(self, signer: Optional[SigningKey]) -> bytes:
        document = asdict(self)
        return json.dumps(sign_document(document, signer) if signer is not None else document,
                          separators=(",", ":")).encode()

    @classmethod
    def from_dict(cls, d: dict) -> "DeadLetter":
        if d.get("schema") != DEAD_LETTER_SCHEMA:
            raise ValueError(f"dead letter schema {d.get('schema')!r} is not {DEAD_LETTER_SCHEMA}")
        return cls(source_topic=str(d["source_topic"]), partition=int(d["partition"]), offset=int(d["offset"]),
                   size=int(d["size"]), sha256=str(d["sha256"]), reason=str(d["reason"]),
                   rollout_id=None if d.get("rollout_id") is None else str(d["rollout_id"]),
                   sampler_id=None if d.get("sampler_id") is None else str(d["sampler_id"]),
                   time=float(d.get("time", 0.0)))

    @property
    def message(self) -> tuple[int, int, Optional[str]]:
        """The message's identity in the audit: (partition, offset, rollout id)."""
        return self.partition, self.offset, self.rollout_id


def _header(record: RawRecord, key: str) -> Optional[str]:
    for k, v in record.headers or []:
        if k == key and v is not None:
            return v.decode("utf-8", "replace")[:HEADER_CHARS]
    return None


@dataclass
class DeadLetters:
    """The dead letters of a rollout topic as read from Kafka: those the learner signed for it, and
    the records refused."""

    letters: list[DeadLetter] = field(default_factory=list)
    refused: list[RefusedRecord] = field(default_factory=list)

    def messages(self) -> set[tuple[int, int, Optional[str]]]:
        return {letter.message for letter in self.letters}

    def refused_by_reason(self) -> dict[str, int]:
        return count_reasons(self.refused)


def parse_dead_letters(records: Iterable[RawRecord], rollout_topic: str,
                       trusted: Optional[PublicKey]) -> DeadLetters:
    """The dead letters of `rollout_topic` among the dead-letter topic's `records`, each verified."""
    found = DeadLetters()
    for r in records:
        try:
            body = verified_control_record(r.value, trusted, f"dead letter {r.partition}@{r.offset}")
            letter = DeadLetter.from_dict(body)
            if letter.source_topic != rollout_topic:
                raise ControlRecordRefused("other_topic")
            found.letters.append(letter)
        except ControlRecordRefused as e:
            found.refused.append(RefusedRecord(r.partition, r.offset, e.reason))
        except (ValueError, KeyError, TypeError) as e:
            found.refused.append(RefusedRecord(r.partition, r.offset,
                                               f"not_an_entry: {type(e).__name__}: {e}"[:200]))
    return found


def read_dead_letters(bootstrap: str, rollout_topic: str, trusted: Optional[PublicKey], timeout_s: float = 10.0,
                      security=None) -> DeadLetters:
    """The dead letters of a rollout topic from Kafka (none if the run set nothing aside)."""
    topic = dead_letter_topic(rollout_topic)
    if not topic_partitions(bootstrap, topic, security):
        return DeadLetters()
    return parse_dead_letters(read_topic(bootstrap, topic, timeout_s=timeout_s, security=security), rollout_topic,
                              trusted)
