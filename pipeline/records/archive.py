"""Export a rollout topic to one Parquet file, and read it back as Kafka records.

Why: a Kafka topic is retained for a while and lives on one broker; a Parquet file is a
self-contained, durable record of a run's data that replay can consume offline and that
any data tool (pandas, DuckDB, Spark) can query. The file keeps the exact message bytes
(replay decodes them with `decode_rollout`, a malformed message stays malformed), the
Kafka coordinates (partition, offset, timestamp, headers), a few decoded convenience
columns, and the learner's verdict on each message joined from the update log. The
update log itself is stored losslessly in the file's key-value metadata, because some
of its facts are per step (the step's policy version, loss type and time). Each entry keeps
the learner's signature: the export reads only the entries the learner's key signed, and a
replay of the file checks them again.

docs/schema.md ("Parquet export") is the normative description of the columns.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.errors import UserError
from pipeline.clients.topics import RawRecord, read_topic, topic_partitions
from pipeline.wire.rollout import Rollout, RolloutDecodeError, decode_rollout, header_value
from pipeline.records.update_log import UpdateEntry, UpdateLog, parse_update_log, read_update_log
from pipeline.wire.signing import PublicKey

ARCHIVE_SCHEMA = "1"
META_SCHEMA = "heterorl.schema"
META_TOPIC = "heterorl.topic"
META_UPDATE_LOG = "heterorl.update_log"

HEADER_TYPE = pa.struct([("key", pa.string()), ("value", pa.binary())])

COLUMNS = pa.schema([
    ("topic", pa.string()),
    ("partition", pa.int32()),
    ("offset", pa.int64()),
    ("timestamp_ms", pa.int64()),
    ("value", pa.binary()),
    ("headers", pa.list_(HEADER_TYPE)),
    ("rollout_id", pa.string()),
    ("sampler_id", pa.string()),
    ("policy_version", pa.int64()),
    ("schema_version", pa.int32()),
    ("prompt_id", pa.string()),
    ("created_at", pa.float64()),
    ("group_size", pa.int32()),
    ("reward_mean", pa.float64()),
    ("decode_error", pa.string()),
    ("update_step", pa.int64()),
    ("verdict", pa.string()),
    ("batch_index", pa.int32()),
    ("recorded_staleness", pa.int64()),
    ("weight", pa.float64()),
    ("drop_reason", pa.string()),
])
"""Column order and types of a schema-1 export (docs/schema.md)."""

_VERDICT_COLUMNS = ("update_step", "verdict", "batch_index", "recorded_staleness", "weight", "drop_reason")


class ArchiveError(UserError, ValueError):
    """An export or archive that cannot be produced or read; the message is one line."""


@dataclass(frozen=True)
class ExportSummary:
    path: Path
    topic: str
    messages: int
    """Rows written: every message of the rollout topic."""
    decodable: int
    """Messages that decode as a valid rollout."""
    in_update_log: int
    """Messages the update log gives a verdict on (used, dropped, malformed or duplicate)."""
    steps: int
    """Optimizer steps in the update log (0 without one)."""
    has_update_log: bool
    refused_update_records: dict
    """Records of the update log that were not the learner's (unsigned, forged, sent again), by
    reason: not exported."""


@dataclass(frozen=True)
class Archive:
    path: Path
    topic: str
    records: list[RawRecord]
    """The rollout topic's messages in (partition, offset) order, as `read_topic` returned them."""
    update_log: Optional[list[UpdateEntry]]
    """The run's update log by step, or None if the topic had none when it was exported."""


# ----------------------------------------------------------------------------- export


def export_topic(bootstrap: str, topic: str, out_path: Path, trusted: Optional[PublicKey]) -> ExportSummary:
    """Write every message of `topic` (and its update log, if any: the entries `trusted`, the
    learner's public key, signed) to one Parquet file."""
    out_path = Path(out_path)
    if not topic_partitions(bootstrap, topic):
        raise ArchiveError(f"topic {topic} does not exist on Kafka at {bootstrap}")
    records = read_topic(bootstrap, topic)
    if not records:
        raise ArchiveError(f"topic {topic} on Kafka at {bootstrap} is empty")
    log: Optional[UpdateLog] = read_update_log(bootstrap, topic, trusted)
    update_log = None if log is None else log.entries
    verdicts = verdicts_by_offset(update_log or [])
    rows = [_row(topic, record, verdicts.get((record.partition, record.offset))) for record in records]
    table = pa.Table.from_pylist(rows, schema=COLUMNS).replace_schema_metadata(_metadata(topic, update_log))
    _write_atomically(table, out_path)
    return ExportSummary(
        path=out_path, topic=topic, messages=len(rows),
        decodable=sum(row["decode_error"] is None for row in rows),
        in_update_log=sum(row["verdict"] is not None for row in rows),
        steps=len(update_log or []), has_update_log=update_log is not None,
        refused_update_records={} if log is None else log.refused_by_reason())


def verdicts_by_offset(entries: list[UpdateEntry]) -> dict[tuple[int, int], dict]:
    """(partition, offset) -> the update-log columns of that message.

    Every consumed offset appears in exactly one entry; should one appear twice (a log
    written by a buggy learner), the earliest step wins, as that is when it was judged.
    """
    verdicts: dict[tuple[int, int], dict] = {}

    def put(partition: int, offset: int, **columns) -> None:
        verdicts.setdefault((partition, offset), {name: None for name in _VERDICT_COLUMNS} | columns)

    for entry in entries:
        for index, g in enumerate(entry.used):
            put(g.partition, g.offset, update_step=entry.step, verdict="used", batch_index=index,
                recorded_staleness=g.staleness, weight=g.weight)
        for g in entry.dropped:
            put(g.partition, g.offset, update_step=entry.step, verdict="dropped",
                recorded_staleness=g.staleness, drop_reason=g.reason)
        for g in entry.malformed:
            put(g.partition, g.offset, update_step=entry.step, verdict="malformed", drop_reason=g.reason)
        for g in entry.duplicates:
            put(g.partition, g.offset, update_step=entry.step, verdict="duplicate")
    return verdicts


def _row(topic: str, record: RawRecord, verdict: Optional[dict]) -> dict:
    headers = list(record.headers or [])
    return {
        "topic": topic, "partition": record.partition, "offset": record.offset,
        "timestamp_ms": record.timestamp_ms, "value": record.value,
        "headers": [{"key": key, "value": value} for key, value in headers],
        "rollout_id": header_value(headers, "rollout_id"), "sampler_id": header_value(headers, "sampler_id"),
        "policy_version": _int_or_none(header_value(headers, "policy_version")),
        "schema_version": _int_or_none(header_value(headers, "schema_version")),
        **_decoded_columns(record.value),
        **(verdict or {name: None for name in _VERDICT_COLUMNS}),
    }


def _decoded_columns(value: bytes) -> dict:
    """Convenience columns from the decoded message; all null, with the reason, if it does not decode."""
    try:
        rollout: Rollout = decode_rollout(value)
    except RolloutDecodeError as e:
        return {"prompt_id": None, "created_at": None, "group_size": None, "reward_mean": None,
                "decode_error": e.reason}
    return {"prompt_id": rollout.prompt_id, "created_at": rollout.created_at, "group_size": rollout.group_size,
            "reward_mean": math.fsum(rollout.rewards) / len(rollout.rewards), "decode_error": None}


def _int_or_none(text: Optional[str]) -> Optional[int]:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _metadata(topic: str, update_log: Optional[list[UpdateEntry]]) -> dict[str, str]:
    metadata = {META_SCHEMA: ARCHIVE_SCHEMA, META_TOPIC: topic}
    if update_log is not None:
        metadata[META_UPDATE_LOG] = "".join(entry.to_json() + "\n" for entry in update_log)
    return metadata


def _write_atomically(table: pa.Table, out_path: Path) -> None:
    """Write next to the target, then rename: a reader never sees half a file."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- read back


def read_archive(path: Path, trusted: Optional[PublicKey]) -> Archive:
    """The records and update log of an export, as they were on Kafka; only the update-log entries
    `trusted` (the learner's public key; None: every entry, for runs without signatures) signed."""
    path = Path(path)
    table = _read_table(path)
    metadata = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
    if META_SCHEMA not in metadata:
        raise ArchiveError(f"{path} is not a heterorl export (no {META_SCHEMA} metadata)")
    if metadata[META_SCHEMA] != ARCHIVE_SCHEMA:
        raise ArchiveError(f"{path} is a heterorl export of schema {metadata[META_SCHEMA]!r}; "
                           f"this version reads schema {ARCHIVE_SCHEMA}")
    missing = [name for name in ("partition", "offset", "value", "timestamp_ms") if name not in table.column_names]
    if missing:
        raise ArchiveError(f"{path} lacks the column(s) {', '.join(missing)}")
    return Archive(path=path, topic=metadata.get(META_TOPIC, ""), records=_records(table),
                   update_log=_update_log(metadata.get(META_UPDATE_LOG), trusted))


def _read_table(path: Path) -> pa.Table:
    if not path.exists():
        raise ArchiveError(f"{path} does not exist")
    if not path.is_file():
        raise ArchiveError(f"{path} is not a file")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ArchiveError(f"{path} is not a Parquet file ({reason})") from None


def _records(table: pa.Table) -> list[RawRecord]:
    wanted = [name for name in ("partition", "offset", "value", "timestamp_ms", "headers", "schema_version",
                                "policy_version", "sampler_id", "rollout_id") if name in table.column_names]
    columns = table.select(wanted).to_pydict()
    rows = range(table.num_rows)
    return [RawRecord(partition=columns["partition"][i], offset=columns["offset"][i], value=columns["value"][i],
                      headers=_headers(columns, i), timestamp_ms=columns["timestamp_ms"][i]) for i in rows]


def _headers(columns: dict, i: int) -> list[tuple[str, bytes]]:
    """The exact Kafka headers when the file has them, else rebuilt as Rollout.headers() orders them."""
    if "headers" in columns:
        return [(h["key"], h["value"]) for h in columns["headers"][i] or []]
    names = [name for name in ("schema_version", "policy_version", "sampler_id", "rollout_id") if name in columns]
    return [(name, str(columns[name][i]).encode()) for name in names if columns[name][i] is not None]


def _update_log(text: Optional[str], trusted: Optional[PublicKey]) -> Optional[list[UpdateEntry]]:
    """The entries of the file's update log that `trusted` signed (the export kept only those)."""
    if text is None:
        return None
    lines = [line for line in text.splitlines() if line.strip()]
    return parse_update_log((RawRecord(0, i, line.encode(), [], 0) for i, line in enumerate(lines)), trusted).entries
