"""One retry curve for every server call: doubling waits up to a bound, with jitter.

Two forms share the curve (`backoff_delay`):

- `retry_call`: blocking. Call a function until it succeeds, sleeping between attempts
  (tenacity does the looping), until a number of attempts or a time budget is spent;
  then the last error is raised as it was. Used where nothing else can happen until
  the call succeeds: the learner's update-log writes, a sampler's first connection,
  one chunk of a checkpoint download.
- `Backoff`: non-blocking. A loop that has other work (a sampler keeps generating while
  the broker is away) asks `ready()` before trying and reports `failed()` / `succeeded()`.

Why jitter: after a broker or Redis restart every client sees the failure at the same
moment; without jitter they would all retry in lockstep and hit the server together.
Each wait is drawn uniformly from [half, all] of the doubling curve ("equal jitter"),
so waits still grow, but clients spread out.
"""

from __future__ import annotations

import random
import time
from typing import Callable, Optional, TypeVar

import tenacity

T = TypeVar("T")


def backoff_delay(failures: int, first_s: float, max_s: float, rng: random.Random | None = None) -> float:
    """Wait after the `failures`-th failure in a row: first_s · 2^(failures−1), at most max_s,
    then drawn uniformly from [half of that, all of it]."""
    base = min(max_s, first_s * 2 ** max(0, failures - 1))
    return (rng or random).uniform(base / 2, base)


class _Doubling(tenacity.wait.wait_base):
    def __init__(self, first_s: float, max_s: float):
        self.first_s, self.max_s = first_s, max_s

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return backoff_delay(retry_state.attempt_number, self.first_s, self.max_s)


def retry_call(fn: Callable[[], T], *, retry_on: tuple[type[BaseException], ...], first_s: float, max_s: float,
               give_up_after_s: Optional[float] = None, attempts: Optional[int] = None,
               on_retry: Optional[Callable[[BaseException, float, int], None]] = None) -> T:
    """`fn()`, retried on the exceptions `retry_on` with jittered doubling waits (but for one whose
    `retryable` attribute is false: a refused password does not get better by waiting).

    Gives up when `attempts` calls have failed, or when the next wait would end past
    `give_up_after_s` from the first call (whichever comes first; neither: never), and
    re-raises the last error unchanged. `on_retry(error, wait_s, failures)` is called
    before each wait (to log what is retried and why).
    """
    stops = []
    if give_up_after_s is not None:
        stops.append(tenacity.stop_before_delay(give_up_after_s))
    if attempts is not None:
        stops.append(tenacity.stop_after_attempt(attempts))

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None:
            on_retry(state.outcome.exception(), state.upcoming_sleep, state.attempt_number)

    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(lambda e: isinstance(e, retry_on) and getattr(e, "retryable", True)),
        wait=_Doubling(first_s, max_s),
        stop=tenacity.stop_any(*stops) if stops else tenacity.stop_never, before_sleep=before_sleep, reraise=True)
    return retrying(fn)


class Backoff:
    """Retry pacing for a loop with other work: jittered doubling waits up to `max_s`, reset on success."""

    def __init__(self, max_s: float, first_s: float = 0.5):
        self.max_s, self.first_s = max_s, first_s
        self.failures = 0
        self.next_try = 0.0

    def ready(self) -> bool:
        return time.monotonic() >= self.next_try

    def failed(self) -> float:
        """Record a failure; returns the wait until `ready()` says True again."""
        self.failures += 1
        wait = backoff_delay(self.failures, self.first_s, self.max_s)
        self.next_try = time.monotonic() + wait
        return wait

    def succeeded(self) -> None:
        self.failures, self.next_try = 0, 0.0
