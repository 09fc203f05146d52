"""A topic reader never skips offsets a fetch left out for a moment (pipeline/clients/topics.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kafka import TopicPartition

import pipeline.clients.topics as topics
from pipeline.clients.topics import TopicReader

TP = TopicPartition("t", 0)


class Fetches:
    """A consumer whose polls answer from a list of fetches (offsets), recording each seek."""

    def __init__(self, *fetches: list[int]):
        self.fetches, self.seeks = list(fetches), []

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        offsets = self.fetches.pop(0) if self.fetches else []
        return {TP: [SimpleNamespace(partition=0, offset=o, value=b"%d" % o, headers=[], timestamp=0)
                     for o in offsets]} if offsets else {}

    def seek(self, tp, offset: int) -> None:
        self.seeks.append(offset)


def reader(consumer: Fetches, start: int | None) -> TopicReader:
    r = TopicReader.__new__(TopicReader)
    r.topic, r.max_records, r.consumer, r.partitions = "t", 64, consumer, [TP]
    r.expected, r.gap_since = ({0: start} if start is not None else {}), {}
    return r


def offsets(records) -> list[int]:
    return [r.offset for r in records]


def test_a_fetch_past_a_gap_reads_the_gap_again_and_nothing_is_skipped(monkeypatch):
    monkeypatch.setattr(topics, "GAP_RETRY_S", 0.0)
    # the learner's fetch at 97 answered with the batch at 110; a moment later 97-109 are there
    consumer = Fetches([95, 96], [110, 111], [97, 98, 99], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
                       [110, 111], [110, 111])
    r = reader(consumer, 95)
    got = []
    for _ in range(6):
        got += offsets(r.poll(0.0))
    assert got == list(range(95, 112)) and consumer.seeks == [97]
    assert r.expected == {0: 112}


def test_a_gap_that_stays_is_read_past_after_the_wait_with_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(topics, "GAP_RETRY_S", 0.0)
    now = [0.0]
    monkeypatch.setattr(topics.time, "monotonic", lambda: now[0])
    consumer = Fetches([0, 1], [5, 6], [5, 6], [5, 6])
    r = reader(consumer, None)  # from the beginning: the first record sets where the next must start
    assert offsets(r.poll(0.0)) == [0, 1]
    assert offsets(r.poll(0.0)) == []
    now[0] = topics.GAP_WAIT_S - 0.1
    assert offsets(r.poll(0.0)) == [] and consumer.seeks == [2, 2]
    now[0] = topics.GAP_WAIT_S + 0.1
    assert offsets(r.poll(0.0)) == [5, 6] and "no message at offsets 2-4" in caplog.text
    assert r.gap_since == {}


@pytest.mark.parametrize("start", [None, 3])
def test_records_in_order_pass_untouched(start):
    consumer = Fetches([3, 4, 5], [6])
    r = reader(consumer, start)
    assert offsets(r.poll(0.0)) + offsets(r.poll(0.0)) == [3, 4, 5, 6] and consumer.seeks == []
