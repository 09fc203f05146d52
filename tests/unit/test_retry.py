"""One retry curve: doubling waits up to a bound, jittered so clients do not retry in lockstep."""

import random

import pytest

from pipeline.clients.retry import Backoff, backoff_delay, retry_call


def test_waits_double_up_to_the_bound_and_are_jittered_within_half_to_all():
    rng = random.Random(0)
    for failures, base in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (9, 10.0)]:
        waits = [backoff_delay(failures, 0.5, 10.0, rng) for _ in range(200)]
        assert all(base / 2 <= w <= base for w in waits)
        assert max(waits) - min(waits) > base / 4  # spread out, not one value


def test_two_clients_failing_together_retry_at_different_times():
    a, b = Backoff(max_s=15.0), Backoff(max_s=15.0)
    waits = [(a.failed(), b.failed()) for _ in range(5)]
    assert any(abs(x - y) > 1e-3 for x, y in waits)
    assert not a.ready()
    a.succeeded()
    assert a.ready() and a.failures == 0


def test_retry_call_retries_the_named_errors_then_succeeds(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls, retries = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("down")
        return "ok"

    assert retry_call(flaky, retry_on=(ConnectionError,), first_s=0.1, max_s=1.0, attempts=5,
                      on_retry=lambda e, wait, n: retries.append((type(e).__name__, n))) == "ok"
    assert len(calls) == 3 and retries == [("ConnectionError", 1), ("ConnectionError", 2)]


def test_retry_call_gives_up_with_the_last_error_and_never_retries_others(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def down():
        calls.append(1)
        raise ConnectionError(f"attempt {len(calls)}")

    with pytest.raises(ConnectionError, match="attempt 4"):
        retry_call(down, retry_on=(ConnectionError,), first_s=0.1, max_s=1.0, attempts=4)

    def bug():
        calls.append(1)
        raise KeyError("a bug")

    calls.clear()
    with pytest.raises(KeyError):
        retry_call(bug, retry_on=(ConnectionError,), first_s=0.1, max_s=1.0, attempts=4)
    assert len(calls) == 1


def test_retry_call_stops_before_a_wait_would_pass_the_time_budget(monkeypatch):
    monkeypatch.setattr("time.sleep", lambda s: None)
    calls = []

    def down():
        calls.append(1)
        raise ConnectionError("down")

    with pytest.raises(ConnectionError):  # first wait is 5..10 s, past a 1 s budget: no retry at all
        retry_call(down, retry_on=(ConnectionError,), first_s=10.0, max_s=10.0, give_up_after_s=1.0)
    assert len(calls) == 1
