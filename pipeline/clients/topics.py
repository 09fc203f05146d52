"""Kafka transport for rollouts: a sink that sends, a source that reads by explicit assignment.

The source never joins a consumer group: the learner assigns itself every partition
and keeps its own offsets (stored with each checkpoint), which is both faster with
the Tansu broker and what crash-safe resumption needs. Values are opaque bytes here;
`pipeline.wire.rollout` encodes and decodes them, so a malformed message reaches the
learner as bytes it can count and set aside.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import NewTopic
from kafka.errors import (AuthorizationError, KafkaError, MessageSizeTooLargeError, RecordListTooLargeError,
                          SaslAuthenticationFailedError, TopicAlreadyExistsError)

from pipeline.wire.rollout import Rollout, encode_rollout, seal_rollout
from pipeline.wire.signing import SigningKey
from pipeline.clients.retry import retry_call
from pipeline.clients.services import CredentialsRefused, ServiceSecurity, ServiceUnavailable

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 * 1024 * 1024

T = TypeVar("T")


def _security_kwargs(security: Optional[ServiceSecurity]) -> dict:
    """TLS / SASL settings for every Kafka client made here (None: plaintext, no auth)."""
    return (security or ServiceSecurity()).kafka_kwargs()


def _unreachable(bootstrap: str, err: Exception) -> ServiceUnavailable:
    if isinstance(err, (SaslAuthenticationFailedError, AuthorizationError)):
        return CredentialsRefused(f"Kafka at {bootstrap} refused the credentials ({type(err).__name__}): check "
                                  "services.kafka_sasl_username / kafka_sasl_password and the user's ACLs")
    return ServiceUnavailable(f"cannot reach Kafka at {bootstrap} ({type(err).__name__}): "
                              "start it (`heterorl up` for the local stack) or fix the URL")


def ensure_topic(bootstrap: str, topic: str, partitions: int = 1, timeout_s: float = 15.0,
                 retention_ms: int = -1, security: Optional[ServiceSecurity] = None) -> None:
    """Create the topic if it does not exist (idempotent); retention -1 keeps every message."""
    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000),
                                 client_id="heterorl-admin", **_security_kwargs(security))
    except KafkaError as e:
        raise _unreachable(bootstrap, e) from None
    try:
        if topic not in admin.list_topics():
            try:
                admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1,
                                              topic_configs={"retention.ms": str(retention_ms)})])
            except TopicAlreadyExistsError:
                pass
            except AuthorizationError:  # a role that may not create topics (a sampler through a gate)
                raise ServiceUnavailable(f"topic {topic} does not exist on Kafka at {bootstrap} yet, and this role "
                                         "may not create it: the run's learner creates it when it starts") from None
    except KafkaError as e:
        raise _unreachable(bootstrap, e) from None
    finally:
        admin.close()
    deadline = time.monotonic() + timeout_s
    while not topic_partitions(bootstrap, topic, security):
        if time.monotonic() > deadline:
            raise ServiceUnavailable(f"topic {topic} did not appear on Kafka at {bootstrap} within {timeout_s:.0f}s")
        time.sleep(0.2)


def topic_partitions(bootstrap: str, topic: str, security: Optional[ServiceSecurity] = None) -> list[int]:
    consumer = _consumer(bootstrap, security)
    try:
        return sorted(consumer.partitions_for_topic(topic) or [])
    finally:
        consumer.close()


def _consumer(bootstrap: str, security: Optional[ServiceSecurity] = None, **kwargs) -> KafkaConsumer:
    try:
        # earliest: a stored offset past the end of the log (a broker that lost data) must
        # re-read what exists, never silently skip to new messages.
        return KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                             auto_offset_reset="earliest",
                             client_id="heterorl", request_timeout_ms=30000,
                             fetch_max_bytes=4 * MAX_MESSAGE_BYTES, max_partition_fetch_bytes=MAX_MESSAGE_BYTES,
                             **_security_kwargs(security), **kwargs)
    except KafkaError as e:
        raise _unreachable(bootstrap, e) from None


def end_offsets(bootstrap: str, topic: str, timeout_s: float = 5.0,
                security: Optional[ServiceSecurity] = None) -> dict[int, int]:
    """Next offset to be written, per partition (the size of the log).

    Tansu answers ListOffsets with the last batch's base offset + 1 after a multi-record
    batch, so the answer is checked against the high watermark of a fetch from there.
    """
    consumer = _consumer(bootstrap, security)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or [])]
        if not parts:
            return {}
        ends = consumer.end_offsets(parts)
        consumer.assign(parts)
        for tp in parts:
            consumer.seek(tp, max(0, ends[tp] - 1))
        deadline = time.monotonic() + timeout_s
        while any(consumer.highwater(tp) is None for tp in parts if ends[tp] > 0) and time.monotonic() < deadline:
            consumer.poll(timeout_ms=200, max_records=1)
        return {tp.partition: _log_end(consumer, tp, ends[tp]) for tp in parts}
    finally:
        consumer.close()


def _log_end(consumer: KafkaConsumer, tp: TopicPartition, listed: int) -> int:
    """The end of a partition's log: Tansu's ListOffsets answer `listed`, corrected by the
    high watermark of the consumer's latest fetch (right even after multi-record batches)."""
    return max(listed, consumer.highwater(tp) or 0)


class TopicWriter:
    """Sends encoded rollouts; `send` returns once the broker has acknowledged (acks=all)."""

    def __init__(self, bootstrap: str, topic: str, send_timeout_s: float = 30.0,
                 connect_timeout_s: float = 30.0, signer: Optional[SigningKey] = None,
                 security: Optional[ServiceSecurity] = None, stamp: Optional[Callable[[Rollout], None]] = None):
        """`signer`: the sampler's key; each rollout then goes out sealed (`seal_rollout`). `stamp`:
        gives a rollout made under another key (spooled before a key change) this key's fields."""
        self.bootstrap, self.topic = bootstrap, topic
        self.signer = signer
        self.stamp = stamp
        self.send_timeout_s = send_timeout_s
        try:
            self.producer = KafkaProducer(
                bootstrap_servers=bootstrap, acks="all", compression_type="gzip", linger_ms=5,
                max_request_size=MAX_MESSAGE_BYTES, request_timeout_ms=int(send_timeout_s * 1000),
                retries=5, retry_backoff_ms=200, client_id="heterorl-sampler",
                # Tansu 0.6 hands the same producer id to concurrent producers, so the
                # idempotent producer's sequence numbers collide (OutOfOrderSequenceNumber).
                # Delivery is at-least-once instead; consumers drop repeated rollout ids.
                enable_idempotence=False,
                bootstrap_timeout_ms=int(connect_timeout_s * 1000), **_security_kwargs(security))
        except KafkaError as e:
            raise _unreachable(bootstrap, e) from None

    def send(self, rollout: Rollout) -> tuple[int, int]:
        """Publish one group; returns (partition, offset) as acknowledged by the broker."""
        return self.send_many([rollout])[0]

    def send_many(self, rollouts: list[Rollout]) -> list[tuple[int, int]]:
        """Publish groups in order, pipelined; returns once every one is acknowledged."""
        futures = [self.producer.send(self.topic, value=self.encode(r), key=r.rollout_id.encode(),
                                      headers=r.headers()) for r in rollouts]
        metas = [f.get(timeout=self.send_timeout_s) for f in futures]
        return [(m.partition, m.offset) for m in metas]

    def encode(self, rollout: Rollout) -> bytes:
        if self.signer is None:
            return encode_rollout(rollout)
        if rollout.key_id != self.signer.key_id and self.stamp is not None:
            self.stamp(rollout)  # same rollout id: the learner still drops a copy sent before the change
        return seal_rollout(rollout, self.signer)

    def send_raw(self, value: bytes, headers: Optional[list[tuple[str, bytes]]] = None,
                 key: Optional[bytes] = None) -> tuple[int, int]:
        """Publish arbitrary bytes (the update log; tests inject malformed messages with it)."""
        meta = self.producer.send(self.topic, value=value, key=key,
                                  headers=headers or []).get(timeout=self.send_timeout_s)
        return meta.partition, meta.offset

    def send_raw_many(self, values: list[bytes]) -> list[tuple[int, int]]:
        """Publish arbitrary messages in order, pipelined; returns once every one is acknowledged."""
        futures = [self.producer.send(self.topic, value=value) for value in values]
        return [(m.partition, m.offset) for m in (f.get(timeout=self.send_timeout_s) for f in futures)]

    def retrying(self, send: Callable[[], T], give_up_after_s: float, log: logging.Logger) -> T:
        """`send()` (one of this writer's sends), retried through broker errors (an outage, or an
        error the broker answers with) with doubling waits up to 30 s, each failure logged, for up
        to `give_up_after_s`; then the last error is raised. Refused credentials and a message too
        large are raised at once: waiting mends neither. Delivery stays at-least-once: a send the
        broker stored before it failed is sent again, and readers drop the repeat."""
        def attempt() -> T:
            try:
                return send()
            except (SaslAuthenticationFailedError, AuthorizationError) as e:
                raise _unreachable(self.bootstrap, e) from None
            except (MessageSizeTooLargeError, RecordListTooLargeError) as e:
                e.retryable = False
                raise

        return retry_call(attempt, retry_on=(KafkaError,), first_s=1.0, max_s=30.0, give_up_after_s=give_up_after_s,
                          on_retry=lambda error, wait_s, _: log.warning(
                              "writing to %s on Kafka at %s failed (%s); retrying in %.0fs", self.topic,
                              self.bootstrap, type(error).__name__, wait_s))

    def close(self) -> None:
        self.producer.flush(timeout=self.send_timeout_s)
        self.producer.close(timeout=self.send_timeout_s)


@dataclass(frozen=True)
class RawRecord:
    partition: int
    offset: int
    value: bytes
    headers: list[tuple[str, bytes]]
    timestamp_ms: int


GAP_WAIT_S = 5.0
"""How long a reader waits for the messages of a gap in a partition's offsets before it reads on
past them (`TopicReader.poll`)."""
GAP_RETRY_S = 0.05


class TopicReader:
    """Reads every partition of a topic from given offsets, without a consumer group.

    A learner once judged offsets 0-96 and 110 on, never 97-109, though the log held all of them
    when the run ended (`heterorl attack` on the local broker, Tansu, whose log is objects in S3;
    a replayed copy of one of the 13 was then used as if new). A fetch at the tail of the log that
    returned a later batch before an earlier one was served is what fits. So a poll that skips
    offsets goes back for them: the records past the gap are not returned, the partition is read
    again from its first missing offset, and only after `GAP_WAIT_S` with the gap still there
    (a log with offsets that hold no message) does the reader read on past it, with a warning."""

    def __init__(self, bootstrap: str, topic: str, start_offsets: Optional[dict[int, int]] = None,
                 max_records: int = 64, security: Optional[ServiceSecurity] = None):
        self.topic = topic
        self.max_records = max_records
        self.consumer = _consumer(bootstrap, security, max_poll_records=max_records)
        partitions = sorted(self.consumer.partitions_for_topic(topic) or [])
        if not partitions:
            self.consumer.close()
            raise ServiceUnavailable(f"topic {topic} does not exist on Kafka at {bootstrap}")
        self.all_partitions = partitions
        """Every partition of the topic (`assign` may read a subset)."""
        self.partitions: list[TopicPartition] = []
        self.expected: dict[int, int] = {}
        """The next offset each partition's messages must start at (unknown until its first read,
        when it starts at the beginning)."""
        self.gap_since: dict[int, float] = {}
        """When each partition's current gap was first seen (monotonic seconds)."""
        self.assign({p: (start_offsets or {}).get(p) for p in partitions})

    def assign(self, start_offsets: dict[int, Optional[int]]) -> None:
        """Read exactly these partitions from now on, each from its offset (None: the beginning).
        A validator calls it whenever the partitions it holds change."""
        self.partitions = [TopicPartition(self.topic, p) for p in sorted(start_offsets)]
        self.consumer.assign(self.partitions)
        self.expected, self.gap_since = {}, {}
        for tp in self.partitions:
            if start_offsets[tp.partition] is not None:
                self.consumer.seek(tp, int(start_offsets[tp.partition]))
                self.expected[tp.partition] = int(start_offsets[tp.partition])
            else:
                self.consumer.seek_to_beginning(tp)

    def poll(self, timeout_s: float) -> list[RawRecord]:
        """The next records, partition by partition, in offset order, none skipped (the class says how)."""
        batches = self.consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=self.max_records)
        records = []
        for tp in sorted(batches, key=lambda t: t.partition):
            records += self._in_order(tp, [RawRecord(r.partition, r.offset, r.value, list(r.headers or []),
                                                     r.timestamp) for r in batches[tp]])
        return records

    def _in_order(self, tp: TopicPartition, fetched: list[RawRecord]) -> list[RawRecord]:
        """Of one partition's fetched records, those up to the first gap in its offsets; at a gap,
        the partition is read again from the first offset missing, until `GAP_WAIT_S` passed."""
        expected = self.expected.get(tp.partition)
        kept = []
        for record in fetched:
            if expected is not None and record.offset < expected:
                continue  # read before (a fetch from before a seek back)
            if expected is not None and record.offset > expected:
                since = self.gap_since.setdefault(tp.partition, time.monotonic())
                if time.monotonic() - since < GAP_WAIT_S:
                    self.consumer.seek(tp, expected)
                    time.sleep(GAP_RETRY_S)  # not a fetch loop at full speed meanwhile
                    break
                log.warning("%s[%d]: no message at offsets %d-%d after %.0fs; reading on at %d", self.topic,
                            tp.partition, expected, record.offset - 1, GAP_WAIT_S, record.offset)
            self.gap_since.pop(tp.partition, None)
            kept.append(record)
            expected = record.offset + 1
        if expected is not None:
            self.expected[tp.partition] = expected
        return kept

    def unread(self, judged: dict[int, int]) -> Optional[int]:
        """Messages past `judged` (next offset per partition), by the high watermarks of the latest
        fetches (no request: cheap enough for every poll); None until every partition was fetched."""
        marks = {tp.partition: self.consumer.highwater(tp) for tp in self.partitions}
        if any(mark is None for mark in marks.values()):
            return None
        return sum(max(0, mark - judged.get(p, 0)) for p, mark in marks.items())

    def positions(self) -> dict[int, int]:
        """Next offset to read per partition (what a checkpoint stores to resume)."""
        return {tp.partition: self.consumer.position(tp, timeout_ms=30000) for tp in self.partitions}

    def lag(self) -> int:
        """Messages not read yet; the fetch high watermark corrects Tansu's ListOffsets answer."""
        ends = self.consumer.end_offsets(self.partitions)
        positions = self.positions()
        return sum(max(0, _log_end(self.consumer, tp, ends[tp]) - positions[tp.partition]) for tp in self.partitions)

    def close(self) -> None:
        self.consumer.close()


def read_topic(bootstrap: str, topic: str, timeout_s: float = 10.0,
               start_offsets: Optional[dict[int, int]] = None,
               security: Optional[ServiceSecurity] = None) -> list[RawRecord]:
    """Every record of a topic up to its end offsets at call time, partition by partition.

    Raises ServiceUnavailable if the log's end cannot be reached within `timeout_s` of
    no progress (a broker that reports more than it serves).
    """
    source = TopicReader(bootstrap, topic, start_offsets=start_offsets, max_records=500, security=security)
    try:
        wanted = end_offsets(bootstrap, topic, security=security)
        records: list[RawRecord] = []
        last_progress = time.monotonic()
        while any(source.consumer.position(tp) < wanted.get(tp.partition, 0) for tp in source.partitions):
            batch = source.poll(1.0)
            fresh = [r for r in batch if r.offset < wanted[r.partition]]
            if fresh:
                records.extend(fresh)
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > timeout_s:
                have = {p: source.consumer.position(TopicPartition(topic, p)) for p in wanted}
                raise ServiceUnavailable(f"reading {topic} at {bootstrap} stalled at offsets {have} "
                                         f"before the end offsets {wanted}")
        records.sort(key=lambda r: (r.partition, r.offset))
        return records
    finally:
        source.close()
