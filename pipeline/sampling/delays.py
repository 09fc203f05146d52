"""Simulated WAN delays for samplers: seeded delay streams and the weight-refresh gate (their
settings: `pipeline.config.delays`).

Why this exists
---------------
HeteroRL's promise is that training stays stable when samplers run on stale weights far
from the learner. To measure that on one machine, a sampler can pretend to be far away:

* **Weight-refresh delay.** When a sampler sees that a newer policy version has been
  published, it waits a random time before loading it (``RefreshGate``).
* **Rollout transit delay.** Each finished prompt group is held for a random time before
  it is published (the one-way WAN latency of a far sampler). The sampler does
  ``hold = transit_stream(model, sampler_id).draw()`` per group; this module only
  provides the stream.

How the paper's setup maps onto this
------------------------------------
The GEPO paper's reference implementation let samplers refresh weights only after a log-normal
random wait whose bounds 60 s and 1920 s hold 99.5 % of the mass. "Bounds at a
confidence level" is turned into the log-normal's parameters by solving

    ln(lower) = mu - z * sigma,   ln(upper) = mu + z * sigma,   z = Phi^-1((1 + c) / 2)

(``lognormal_params``), i.e. ``lower`` and ``upper`` are the (1-c)/2 and (1+c)/2
quantiles. For 60..1920 s at 99.5 %: mu ~ 5.827 (median ~ 339 s), sigma ~ 0.617.
That is ``DelayModelConfig(refresh=DelayDistributionConfig(kind="lognormal"))``, the
field defaults being the paper's numbers. We improve on the reference in two ways it
got wrong: every sampler draws from its *own* stream (the reference
gave all samplers the same delay seed, so their delays were perfectly correlated), and
the transit delay exists at all (the reference only delayed refreshes).

Wall-clock delays of tens of minutes make small runs long and timing-dependent, so
``unit="steps"`` offers a reproducible variant: a sampler refreshes only once it is
``k`` versions behind the newest, ``k`` drawn from the same distribution (its bounds
then read as versions, e.g. ``lower=1, upper=64``). The transit delay is always in
seconds: versions do not advance while a group is in transit.

Shape
-----
Everything here is pure: no I/O, no Kafka, no torch; time comes from an injectable
``clock`` so the gate is tested with a fake one. The random streams are numpy
Generators seeded from a hash of (config seed, sampler id, purpose), so two samplers,
or the refresh and transit draws of one sampler, never share a stream, and a rerun
with the same ids draws the same delays. ``kind="none"`` (the default) draws 0 and
leaves the sampler's behaviour exactly as without this module.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
from typing import Callable, Optional

import numpy as np

from pipeline.config.delays import DelayDistributionConfig, DelayModelConfig, lognormal_params

REFRESH_PURPOSE = "refresh"
"""Purpose string of the weight-refresh stream (used by ``RefreshGate``)."""
TRANSIT_PURPOSE = "transit"
"""Purpose string of the rollout-transit stream (see ``transit_stream``)."""

def _stream_seed(seed: int, sampler_id: str, purpose: str) -> list[int]:
    # Hash rather than add/xor: seeds and ids that merely differ by an offset must still
    # give unrelated streams, negative seeds must work, and ids are arbitrary strings.
    digest = hashlib.blake2b(
        f"heterorl-delay\x1f{int(seed)}\x1f{sampler_id}\x1f{purpose}".encode(), digest_size=16
    ).digest()
    return [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]


class DelayStream:
    """Seeded draws for one sampler: its own numpy Generator from (config seed, sampler id, purpose)."""

    def __init__(self, dist: DelayDistributionConfig, seed: int, sampler_id: str, purpose: str):
        self.dist = dist
        self.seed = int(seed)
        self.sampler_id = str(sampler_id)
        self.purpose = str(purpose)
        self._rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(
            _stream_seed(self.seed, self.sampler_id, self.purpose))))
        self._mu_sigma: Optional[tuple[float, float]] = None
        if dist.kind == "lognormal":
            self._mu_sigma = lognormal_params(dist.lower, dist.upper, dist.confidence)

    def draw(self) -> float:
        """One delay, finite and >= 0. `none` -> 0.0 and `fixed` -> `value` (neither consumes
        randomness); `lognormal` / `weibull` draw from this stream's generator."""
        kind = self.dist.kind
        if kind == "none":
            return 0.0
        if kind == "fixed":
            return float(self.dist.value)
        if kind == "lognormal":
            mu, sigma = self._mu_sigma  # type: ignore[misc]
            x = float(self._rng.lognormal(mu, sigma))
        else:  # weibull
            x = float(self.dist.scale * self._rng.weibull(self.dist.shape))
        # Clip to [0, largest float]: with extreme parameters (e.g. a tiny confidence, hence
        # a huge sigma) numpy can return inf, which no wait or step count can use.
        if not x >= 0.0:
            return 0.0
        return min(x, sys.float_info.max)

    def draw_steps(self) -> int:
        """One delay in versions (for unit="steps"): `draw()` rounded to the nearest
        integer, halves rounded up (floor(x + 0.5)), never negative. A draw of 0 and of 1
        behave alike in `RefreshGate`: both refresh as soon as any newer version exists."""
        return max(0, int(math.floor(self.draw() + 0.5)))


def stream_key(run_name: str, sampler_id: str) -> str:
    """What a sampler's delay streams are keyed on: its id without its run's name (`s0` for
    `smoke-20261205-035649-s0`, an id `heterorl train` gives), so one `seed` draws the same delays
    in every run of a config, whatever its start time; any other id is kept whole."""
    return sampler_id.removeprefix(f"{run_name}-") or sampler_id


def refresh_stream(model: DelayModelConfig, sampler_id: str) -> DelayStream:
    """The weight-refresh stream of `sampler_id` (the one `RefreshGate` uses)."""
    return DelayStream(model.refresh, model.seed, sampler_id, REFRESH_PURPOSE)


def transit_stream(model: DelayModelConfig, sampler_id: str) -> DelayStream:
    """The rollout-transit stream of `sampler_id`: `hold = stream.draw()` seconds per finished group."""
    return DelayStream(model.transit, model.seed, sampler_id, TRANSIT_PURPOSE)


class RefreshGate:
    """Decides when a sampler may load a newer policy version it has seen.

    seconds mode: the first time a newer version is seen, draw a wait w; load once w
    seconds have passed since then (a still-newer version seen while waiting does not
    restart the wait; after loading, the next newer version draws a new wait).
    steps mode: draw k (at the first sight of a newer version); load only once
    (newest_version - current_version) >= k; after loading, draw a new k.

    Once `should_load` has said True it keeps saying True (for a newer version) until
    `loaded()` is called, so a failed download is simply retried. The first load
    (`current_version is None`) is always immediate and draws nothing.

    `stats` (for metrics): `refreshes` — completed loads after the first; `delayed_refreshes`
    — those for which `should_load` said False at least once first; `refresh_wait_s` —
    total clock time from first seeing a newer version to being allowed to load it.
    """

    def __init__(self, model: DelayModelConfig, sampler_id: str, clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.sampler_id = str(sampler_id)
        self._clock = clock
        self._stream = refresh_stream(model, self.sampler_id)
        self._first_seen: Optional[float] = None   # clock when the pending refresh was first seen
        self._wait: Optional[float] = None         # drawn seconds (seconds mode) or k (steps mode)
        self._deadline: Optional[float] = None     # seconds mode: first_seen + wait
        self._allowed_at: Optional[float] = None   # clock when should_load first said True
        self._was_delayed = False
        self.stats: dict = {"refreshes": 0, "delayed_refreshes": 0, "forced_refreshes": 0, "refresh_wait_s": 0.0}

    @property
    def pending_wait(self) -> Optional[float]:
        """The wait drawn for the refresh in progress (seconds, or k in steps mode); None if none."""
        return self._wait

    def should_load(self, current_version: Optional[int], newest_version: int) -> bool:
        """Whether to load `newest_version` now, given the loaded `current_version`
        (None: nothing loaded yet -> always True). False when nothing newer exists."""
        if current_version is None:
            return True
        if newest_version <= current_version:
            return False
        now = self._clock()
        if self._allowed_at is not None:
            return True
        if self._first_seen is None:
            self._first_seen = now
            if self.model.unit == "steps":
                self._wait = self._stream.draw_steps()
            else:
                self._wait = self._stream.draw()
                # Compare against the deadline, not `now - first_seen >= wait`: the latter can
                # miss by one ulp when the clock reads exactly first_seen + wait.
                self._deadline = now + self._wait
        if self.model.unit == "steps":
            ok = newest_version - current_version >= self._wait  # type: ignore[operator]
        else:
            ok = now >= self._deadline  # type: ignore[operator]
        if ok:
            self._allowed_at = now
        else:
            self._was_delayed = True
        return ok

    def loaded(self, forced: bool = False) -> None:
        """Call after a successful load: records the refresh and re-arms the gate.

        ``forced``: the sampler loaded before the gate allowed it (it was too far behind to
        produce usable data, see pipeline.sampling.pacing.too_far_behind); counted apart, its wait cut short."""
        if forced and self._allowed_at is None and self._first_seen is not None:
            self._allowed_at = self._clock()
            self.stats["forced_refreshes"] += 1
        if self._allowed_at is not None and self._first_seen is not None:
            self.stats["refreshes"] += 1
            self.stats["delayed_refreshes"] += int(self._was_delayed)
            self.stats["refresh_wait_s"] += max(0.0, self._allowed_at - self._first_seen)
        self._first_seen = None
        self._wait = None
        self._deadline = None
        self._allowed_at = None
        self._was_delayed = False
