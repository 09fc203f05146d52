"""The on-disk spool: order, durability, crash recovery, bounds, stale discards, flushing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka.errors import KafkaTimeoutError

import pipeline.clients.spool as spool_module
from pipeline.wire.rollout import RolloutDecodeError, encode_rollout
from pipeline.clients.spool import (RECORD_HEADER, RolloutSpool, SpoolLockedError, list_segments, read_pointer,
                            segment_path)
from tests.unit.test_rollout import make_rollout

BIG = 1 << 30


def rollouts(n: int, start: int = 0, **over) -> list:
    return [make_rollout(prompt_id=f"p{i}", **over) for i in range(start, start + n)]


def ids(items) -> list[str]:
    return [r.prompt_id for r in items]


def record_size(rollout) -> int:
    return RECORD_HEADER.size + len(encode_rollout(rollout))


def open_spool(directory: Path, max_bytes: int = BIG, max_groups: int = 10_000, **kw) -> RolloutSpool:
    return RolloutSpool(directory, max_bytes=max_bytes, max_groups=max_groups, **kw)


class FlakySink:
    """Accepts `ok_records` groups in total, then every send raises like an unreachable broker.

    Like the real producer, a failing batch may deliver a prefix before it raises.
    """

    def __init__(self, ok_records: int):
        self.ok_records = ok_records
        self.received: list = []

    def send_many(self, items: list) -> list[tuple[int, int]]:
        room = self.ok_records - len(self.received)
        self.received += items[:max(0, room)]
        if room < len(items):
            raise KafkaTimeoutError("Timeout after waiting for 2.0 secs.")
        return [(0, i) for i in range(len(self.received) - len(items), len(self.received))]


def test_peek_returns_oldest_first_and_commit_advances(tmp_path):
    spool = open_spool(tmp_path)
    sent = rollouts(5)
    assert all(spool.append(r) for r in sent)
    assert spool.pending() == 5
    assert spool.pending_bytes() == sum(record_size(r) for r in sent)
    assert spool.peek(3) == sent[:3]  # decoded back exactly, in append order
    assert spool.peek(100) == sent
    spool.commit(2)
    assert ids(spool.peek(10)) == ["p2", "p3", "p4"]
    spool.commit(3)
    assert spool.pending() == 0 and spool.pending_bytes() == 0 and spool.peek(5) == []
    assert spool.stats() == {"appended": 5, "delivered": 5, "discarded_stale": 0, "refused_full": 0,
                             "torn_records": 0, "pending": 0, "pending_bytes": 0}
    with pytest.raises(ValueError):
        spool.commit(1)
    spool.close()


def test_reopen_after_commit_resumes_at_the_first_undelivered_record(tmp_path):
    with open_spool(tmp_path) as spool:
        for r in rollouts(6):
            spool.append(r)
        spool.commit(4)
    with open_spool(tmp_path) as spool:
        assert spool.pending() == 2
        assert ids(spool.peek(10)) == ["p4", "p5"]
        spool.append(make_rollout(prompt_id="p6"))
        spool.commit(1)
    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p5", "p6"]
        assert spool.stats()["torn_records"] == 0


def test_delivered_segments_are_deleted_and_a_leftover_one_is_removed_on_open(tmp_path):
    one = record_size(make_rollout(prompt_id="p0"))
    with open_spool(tmp_path, segment_bytes=2 * one) as spool:  # two records per segment
        for r in rollouts(5):
            spool.append(r)
        assert list_segments(tmp_path) == [1, 2, 3]
        spool.commit(3)  # all of segment 1, half of segment 2
        assert list_segments(tmp_path) == [2, 3]
        assert ids(spool.peek(10)) == ["p3", "p4"]
    # A crash between writing the pointer and deleting a delivered segment leaves it behind.
    segment_path(tmp_path, 1).write_bytes(segment_path(tmp_path, 2).read_bytes())
    with open_spool(tmp_path, segment_bytes=2 * one) as spool:
        assert list_segments(tmp_path) == [2, 3]
        assert ids(spool.peek(10)) == ["p3", "p4"]


@pytest.mark.parametrize("cut", ["mid_header", "mid_payload", "garbage", "zero_fill"])
def test_a_torn_tail_is_truncated_counted_and_appending_works_after(tmp_path, cut):
    with open_spool(tmp_path) as spool:
        for r in rollouts(3):
            spool.append(r)
    path = segment_path(tmp_path, 1)
    whole = path.read_bytes()
    last = record_size(make_rollout(prompt_id="p2"))
    intact = whole[:-last]
    damaged = {
        "mid_header": intact + whole[-last:][:5],  # crash after 5 bytes of the next record's header
        "mid_payload": whole[:-7],  # the last record lost its final bytes
        "garbage": intact + bytes([whole[-last] ^ 0xFF]) + whole[-last + 1:],  # a bad length / crc
        "zero_fill": intact + bytes(4096),  # a filesystem that extended the file with zeros
    }[cut]
    path.write_bytes(damaged)

    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p0", "p1"]
        assert spool.stats()["torn_records"] == 1
        assert path.stat().st_size == len(intact)
        assert spool.append(make_rollout(prompt_id="p3"))
        assert ids(spool.peek(10)) == ["p0", "p1", "p3"]
    with open_spool(tmp_path) as spool:  # the repaired log reads cleanly
        assert ids(spool.peek(10)) == ["p0", "p1", "p3"]
        assert spool.stats()["torn_records"] == 0


def test_a_checksum_mismatch_is_torn_even_when_the_length_fits(tmp_path):
    with open_spool(tmp_path) as spool:
        for r in rollouts(2):
            spool.append(r)
    path = segment_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the last payload
    path.write_bytes(bytes(data))
    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p0"]
        assert spool.stats()["torn_records"] == 1


def test_full_spool_refuses_counts_and_accepts_again_after_commit(tmp_path):
    spool = open_spool(tmp_path, max_groups=3)
    assert [spool.append(r) for r in rollouts(4)] == [True, True, True, False]
    assert spool.stats()["refused_full"] == 1 and spool.pending() == 3
    assert ids(spool.peek(10)) == ["p0", "p1", "p2"]  # the refused one was not written
    spool.commit(1)
    assert spool.append(make_rollout(prompt_id="p3"))
    assert ids(spool.peek(10)) == ["p1", "p2", "p3"]
    spool.close()

    one = record_size(make_rollout(prompt_id="p0"))
    by_bytes = open_spool(tmp_path / "bytes", max_bytes=2 * one + one // 2)
    assert [by_bytes.append(r) for r in rollouts(3)] == [True, True, False]
    assert by_bytes.pending_bytes() == 2 * one
    by_bytes.commit(2)
    assert by_bytes.append(make_rollout(prompt_id="p2"))
    by_bytes.close()


def test_an_oversized_group_is_accepted_only_into_an_empty_spool(tmp_path):
    """Otherwise a group bigger than max_bytes would block its sampler forever."""
    spool = open_spool(tmp_path, max_bytes=10)
    assert spool.append(make_rollout(prompt_id="big"))
    assert not spool.append(make_rollout(prompt_id="next"))
    spool.commit(1)
    assert spool.append(make_rollout(prompt_id="next"))
    spool.close()


def test_a_group_the_learner_could_not_decode_is_refused_before_writing(tmp_path):
    spool = open_spool(tmp_path)
    with pytest.raises(RolloutDecodeError):
        spool.append(make_rollout(rewards=[float("nan"), 0.0, 0.0]))
    assert spool.pending() == 0 and segment_path(tmp_path, 1).stat().st_size == 0
    spool.close()


def test_discard_stale_keeps_the_order_of_the_rest_and_returns_the_discarded(tmp_path):
    spool = open_spool(tmp_path)
    versions = [1, 5, 2, 6, 7, 3]
    for i, v in enumerate(versions):
        spool.append(make_rollout(prompt_id=f"p{i}", policy_version=v))
    discarded = spool.discard_stale(lambda r: r.policy_version < 4)
    assert ids(discarded) == ["p0", "p2", "p5"]
    assert ids(spool.peek(10)) == ["p1", "p3", "p4"]
    assert spool.stats()["discarded_stale"] == 3
    assert spool.discard_stale(lambda r: r.policy_version < 4) == []
    assert spool.append(make_rollout(prompt_id="p6", policy_version=8))
    spool.close()
    with open_spool(tmp_path) as reopened:
        assert ids(reopened.peek(10)) == ["p1", "p3", "p4", "p6"]
        assert reopened.pending_bytes() == sum(record_size(r) for r in reopened.peek(10))


def test_discard_stale_interrupted_before_the_pointer_switch_changes_nothing(tmp_path, monkeypatch):
    with open_spool(tmp_path) as spool:
        for i, v in enumerate([1, 5, 2]):
            spool.append(make_rollout(prompt_id=f"p{i}", policy_version=v))

        def crash(*_):
            raise OSError("simulated crash")
        monkeypatch.setattr(spool_module, "write_pointer", crash)
        with pytest.raises(OSError):
            spool.discard_stale(lambda r: r.policy_version < 4)
    monkeypatch.undo()
    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p0", "p1", "p2"]
        assert not list(tmp_path.glob("*.tmp"))


def test_discard_stale_interrupted_after_the_pointer_switch_is_finished_on_open(tmp_path, monkeypatch):
    with open_spool(tmp_path) as spool:
        for i, v in enumerate([1, 5, 2, 6]):
            spool.append(make_rollout(prompt_id=f"p{i}", policy_version=v))

        def crash(*_):
            raise OSError("simulated crash")
        monkeypatch.setattr(spool_module, "_publish_rewritten_segment", crash)
        with pytest.raises(OSError):
            spool.discard_stale(lambda r: r.policy_version < 4)
    monkeypatch.undo()
    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p1", "p3"]
        assert list_segments(tmp_path) == [2]
        assert not list(tmp_path.glob("*.tmp"))


def test_flush_stops_at_a_failure_keeps_the_rest_and_later_delivers_it_in_order(tmp_path):
    spool = open_spool(tmp_path)
    sent = rollouts(10)
    for r in sent:
        spool.append(r)
    down = FlakySink(ok_records=4)
    assert spool.flush_to(down, batch=3) == 3  # one full batch acknowledged; the 2nd failed after 1
    assert spool.last_error.startswith("KafkaTimeoutError")
    assert ids(spool.peek(100)) == ids(sent[3:])  # nothing committed past the acknowledged batch

    up = FlakySink(ok_records=BIG)
    assert spool.flush_to(up, batch=3) == 7
    assert spool.last_error is None and spool.pending() == 0
    assert ids(up.received) == ids(sent[3:])
    # At-least-once: p3 reached the broker twice (prefix of the failed batch, then again).
    delivered_somewhere = ids(down.received) + ids(up.received)
    assert sorted(set(delivered_somewhere)) == sorted(ids(sent))
    first_copies = list(dict.fromkeys(delivered_somewhere))
    assert first_copies == ids(sent)  # first copies arrive in append order
    assert spool.stats()["delivered"] == 10
    spool.close()


def test_flush_discards_stale_first_and_hands_them_over(tmp_path):
    spool = open_spool(tmp_path)
    for i, v in enumerate([1, 5, 2, 6]):
        spool.append(make_rollout(prompt_id=f"p{i}", policy_version=v))
    sink, handed = FlakySink(ok_records=BIG), []
    assert spool.flush_to(sink, is_stale=lambda r: r.policy_version < 4, on_discarded=handed.extend) == 2
    assert ids(sink.received) == ["p1", "p3"] and ids(handed) == ["p0", "p2"]
    spool.close()


def test_flush_lets_a_programming_error_through(tmp_path):
    class Broken:
        def send_many(self, items):
            raise TypeError("a bug, not an outage")

    spool = open_spool(tmp_path)
    spool.append(make_rollout())
    with pytest.raises(TypeError):
        spool.flush_to(Broken())
    assert spool.pending() == 1
    spool.close()


def test_every_append_and_pointer_write_is_fsynced(tmp_path, monkeypatch):
    spool = open_spool(tmp_path)
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    for r in rollouts(3):
        spool.append(r)
    assert len(calls) == 3
    calls.clear()
    spool.commit(2)
    assert len(calls) >= 2  # the pointer's temporary file and the directory after the rename
    assert read_pointer(tmp_path) is not None
    spool.close()


def test_a_second_opener_is_refused(tmp_path):
    with open_spool(tmp_path):
        with pytest.raises(SpoolLockedError):
            open_spool(tmp_path)
    open_spool(tmp_path).close()  # released on close


def test_a_lost_pointer_replays_everything_rather_than_losing_anything(tmp_path):
    with open_spool(tmp_path) as spool:
        for r in rollouts(3):
            spool.append(r)
        spool.commit(1)
    (tmp_path / "committed").write_text("{not json")
    with open_spool(tmp_path) as spool:
        assert ids(spool.peek(10)) == ["p0", "p1", "p2"]


# --- property: random appends, commits, discards and reopens against a list model ---------

operations = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 4)),
    st.tuples(st.just("commit"), st.integers(0, 6)),
    st.tuples(st.just("discard"), st.integers(2, 5)),
    st.tuples(st.just("reopen"), st.just(0)),
), max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, segment_records=st.integers(1, 4), max_groups=st.integers(1, 8))
def test_spool_behaves_like_a_bounded_fifo_across_reopens(ops, segment_records, max_groups):
    one = record_size(make_rollout(prompt_id="p000"))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)

        def reopen():
            return open_spool(directory, max_groups=max_groups, segment_bytes=segment_records * one)

        spool, model, counter = reopen(), [], 0
        try:
            for op, arg in ops:
                if op == "append":
                    for _ in range(arg):
                        rollout = make_rollout(prompt_id=f"p{counter:03d}", policy_version=counter % 7)
                        counter += 1
                        accepted = spool.append(rollout)
                        assert accepted == (len(model) < max_groups)
                        if accepted:
                            model.append(rollout.prompt_id)
                elif op == "commit":
                    n = min(arg, len(model))
                    spool.commit(n)
                    model = model[n:]
                elif op == "discard":
                    stale = {p for p in model if int(p[1:]) % 7 % arg == 0}
                    assert ids(spool.discard_stale(lambda r: r.prompt_id in stale)) == [p for p in model if p in stale]
                    model = [p for p in model if p not in stale]
                else:
                    spool.close()
                    spool = reopen()
                assert ids(spool.peek(len(model) + 1)) == model
                assert spool.pending() == len(model)
            spool.close()
            spool = reopen()
            assert ids(spool.peek(len(model) + 1)) == model
            assert spool.stats()["torn_records"] == 0
        finally:
            spool.close()
