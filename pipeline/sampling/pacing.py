"""Pacing: whether a sampler should generate now, or pause and why. No I/O.

Generating costs compute, so a sampler pauses, for a named reason, when what it would
make now could not be used or has nowhere to go:

- `no_policy`: no weights loaded yet (none published, or the first download is running);
- `spool_full`: the broker has been away so long that the on-disk spool is full;
- `behind`: its weights are so far behind the learner, counting the learner steps that
  the groups already queued ahead will take, that a new group would arrive past the
  learner's max delay and be dropped (`too_far_behind`);
- `backlog`: the learner has more than `sampler.max_backlog_groups` groups to read;
- `next_version` (only with `sampler.wait_for_next_version`): the learner has a full batch to
  train on, or a newer version than the one loaded here: what is made now would be stale when
  used, so the sampler waits to make it with the weights the learner will train it at.
The backlog is the fleet's: groups being generated (claimed prompts), spooled here, and in
the topic but not yet judged by the learner.

The sampler reads what this needs from Redis once (`pipeline.clients.run_state.RunView`), and
each check here is a plain function of those numbers, so it is tested without servers. How long
each pause lasts and where it is counted (`Pauses`) is here too; the sampler does the sleeping.
"""

from __future__ import annotations

from typing import Literal, Optional, Sequence

PauseReason = Literal["no_policy", "spool_full", "behind", "backlog", "next_version"]


def too_far_behind(newest_version: Optional[int], current_version: Optional[int], backlog_groups: int,
                   groups_per_step: int, max_delay_steps: int, generating_steps: int = 0) -> bool:
    """Whether a group generated now would be past the learner's max delay when it is used.

    Its staleness at use is about (newest − current) + floor(backlog / groups_per_step) +
    generating_steps: the versions the sampler is already behind, the steps the learner takes
    on the groups queued ahead of it, and the steps it takes on other samplers' groups while
    this one generates (a slow sampler is overtaken by fast ones). Past max_delay_steps the
    learner drops it, so generating it is wasted compute. `newest_version` is the learner's
    newest as far as known, published or still being published (`RunView.version_at_use`):
    the published one alone is a step behind while a version uploads. (What happens between
    the learner's reports is unknown here, so this can under-estimate, never over-estimate.)
    """
    if newest_version is None or current_version is None:
        return False
    ahead_steps = backlog_groups // max(1, groups_per_step)
    return (newest_version - current_version) + ahead_steps + generating_steps > max_delay_steps


class StepPeriod:
    """How many learner steps pass while this sampler generates a batch, from when it first saw
    each of the last `window` versions (no I/O: the caller gives the times)."""

    def __init__(self, window: int = 8):
        self.window = window
        self.seen: list[tuple[int, float]] = []

    def observe(self, version: Optional[int], now: float) -> None:
        if version is not None and (not self.seen or version > self.seen[-1][0]):
            self.seen = (self.seen + [(version, now)])[-self.window:]

    def versions(self) -> list[int]:
        """The last `window` versions seen published, oldest first."""
        return [version for version, _ in self.seen]

    def seconds_per_step(self, now: Optional[float] = None) -> Optional[float]:
        """Seconds per version over the window; at least the time since the newest version was
        first seen (a learner that slowed down or waits for data is not assumed to go on fast)."""
        if len(self.seen) < 3:  # the first interval starts at an arbitrary moment: two needed
            return None
        (v0, t0), (v1, t1) = self.seen[1], self.seen[-1]
        period = (t1 - t0) / (v1 - v0)
        return period if now is None else max(period, now - t1)

    def steps_during(self, seconds: Optional[float], now: Optional[float] = None) -> int:
        """Whole learner steps in `seconds` (0 while unknown): never an over-estimate of the rate seen."""
        period = self.seconds_per_step(now)
        if not seconds or not period:
            return 0
        return int(seconds // period)


class Pacing:
    """The pause rules of one sampler, from the learner's batch size and max delay."""

    def __init__(self, groups_per_step: int, max_delay_steps: int, max_backlog_groups: Optional[int],
                 wait_for_next_version: bool = False, margin_steps: int = 0):
        self.groups_per_step, self.max_delay_steps = groups_per_step, max_delay_steps
        self.max_backlog_groups = max_backlog_groups
        self.wait_for_next_version = wait_for_next_version
        self.aim_steps = max(0, max_delay_steps - margin_steps)
        """The staleness at use that new groups are paced for (`sampler.pacing_margin_steps`
        inside the max delay); `too_stale` still judges finished groups by the max delay."""

    @staticmethod
    def backlog(spooled_here: int, acked_up_to: dict[int, int], learner_offsets: dict[int, int],
                learner_unread: Optional[int] = None, in_flight: int = 0, unjudged: Optional[int] = None,
                learner_pending: int = 0) -> int:
        """Groups ahead of the next one this sampler would make, the whole fleet's:
        - `in_flight`: prompts claimed and not yet spooled (being generated or in transit);
        - the groups spooled or sent but not yet judged by the learner: the most of what we know
          (spooled here + acknowledged to us past the learner's position), the learner's own
          `learner_unread` (as of its last report), and `unjudged`, the groups the fleet has
          spooled that the learner has not judged, per sampler (`run_state.fleet_unjudged`; live:
          the learner reports only between steps, and what arrives during a step would otherwise
          go unseen);
        - `learner_pending`: groups the learner judged into its partly filled batch.

        Counting the whole fleet matters: each sampler alone sees only its own groups, so with
        many samplers the groups in flight and those sent by others went uncounted, the queue
        grew past the max delay and most of it was dropped (`heterorl loadtest`, docs/loadtest.md)."""
        ours = sum(max(0, end - learner_offsets.get(p, 0)) for p, end in acked_up_to.items())
        fleet = unjudged or 0
        return in_flight + max(spooled_here + max(ours, learner_unread or 0), fleet) + learner_pending

    def in_flight_limit(self, newest: Optional[int], current: Optional[int], backlog_outside_claims: int,
                        generating_steps: int = 0) -> Optional[int]:
        """The most claims the fleet may hold so that the last group of a batch claimed now is
        still within the max delay (`too_far_behind` solved for the claims; None: no limit yet).
        `backlog_outside_claims`: the backlog without the fleet's claims (spooled here + unread)."""
        if newest is None or current is None:
            return None
        steps = self.aim_steps - (newest - current) - generating_steps
        return max(0, (steps + 1) * self.groups_per_step - backlog_outside_claims)

    def behind(self, newest: Optional[int], current: Optional[int], backlog: int, generating_steps: int = 0) -> bool:
        return too_far_behind(newest, current, backlog, self.groups_per_step, self.aim_steps, generating_steps)

    def catch_up_to(self, newest: Optional[int], current: Optional[int], backlog: int,
                    generating_steps: int = 0, published: Sequence[int] = ()) -> Optional[int]:
        """The version to download next: `newest`, unless the sampler holds one it is `behind`
        with; then the oldest of `published` (the versions it has seen published) it would
        generate at again with a step to spare (`aim_steps` less the backlog's steps and
        `generating_steps`: the caller's count of a download's and a batch's), so that it makes groups there while it downloads the
        rest, instead of pausing for the whole way (a joiner's first keyframe is minutes old on a
        slow link). Only a version seen published is named: a learner publishes every
        `learner.sync_every` steps, and the steps between have no version. `newest` where no
        version is near enough."""
        if newest is None or current is None or not self.behind(newest, current, backlog, generating_steps):
            return newest
        versions_behind_allowed = self.aim_steps - backlog // max(1, self.groups_per_step) - generating_steps
        oldest_near_enough = newest - versions_behind_allowed + 1  # newer than `current`: that one is behind
        return min((v for v in published if v >= oldest_near_enough), default=newest)

    def too_stale(self, newest: Optional[int], rollout_version: int) -> bool:
        """A finished group the learner would drop already (judged with the newest version known)."""
        return newest is not None and newest - rollout_version > self.max_delay_steps

    def next_version_due(self, current: Optional[int], backlog: int, learner_version: Optional[int]) -> bool:
        """Whether a group made now would be stale when used although waiting would make it
        fresh: the learner has a full batch to train on (a step, then a new version, comes first),
        or has made a version newer than `current` (being published, or being loaded here)."""
        return backlog >= self.groups_per_step or (
            learner_version is not None and current is not None and current < learner_version)

    def pause_reason(self, *, has_policy: bool, spool_has_room: bool, newest: Optional[int],
                     current: Optional[int], backlog: int, generating_steps: int = 0,
                     learner_version: Optional[int] = None) -> Optional[PauseReason]:
        """Why not to generate now, in the order the reasons are checked; None: generate.
        `learner_version`: the learner's newest version, published or not (`next_version`)."""
        if not has_policy:
            return "no_policy"
        if not spool_has_room:
            return "spool_full"
        if self.behind(newest, current, backlog, generating_steps):
            return "behind"
        if self.max_backlog_groups is not None and backlog > self.max_backlog_groups:
            return "backlog"
        if self.wait_for_next_version and self.next_version_due(current, backlog, learner_version):
            return "next_version"
        return None


PAUSE_STATS = {"spool_full": "paused_spool_full_s", "behind": "stalled_behind_s", "backlog": "paused_backlog_s",
               "redis": "paused_redis_s", "learner_busy": "yielded_to_learner_s",
               "next_version": "waited_for_next_version_s"}
"""Where each pause is counted in the sampler's stats (waiting for a first policy is not)."""
PAUSE_SECONDS = {"no_policy": 0.5, "spool_full": 0.5, "behind": 0.05, "backlog": 0.05, "redis": 0.2,
                 "next_version": 0.02}
"""How long the first pause of each kind sleeps before the next turn looks again."""
PAUSE_MAX_S = {"next_version": 0.1}
"""Pauses of the same kind in a row double up to this long (default 1 s): a sampler waiting for
the learner's next version looks often, as every moment it waits is the learner's too."""


class Pauses:
    """How long a sampler's next pause lasts, and its pauses counted by kind (its stats). The
    caller sleeps: nothing here does.

    The same pause again and again backs off (up to `PAUSE_MAX_S`): a paused sampler's Redis
    reads would otherwise grow the fleet's load with its size (docs/loadtest.md). Stalls while
    behind (waiting for a refresh instead of making data that would be dropped) are also counted
    as episodes; one ends when the sampler is no longer behind."""

    def __init__(self):
        self.seconds: dict[str, float] = {key: 0.0 for key in PAUSE_STATS.values()} | {"stalls_behind": 0}
        self.stalled = False
        self.last: Optional[str] = None
        """The kind of the last pause, None once the sampler generated since."""
        self.streak = 0

    def next(self, reason: str) -> float:
        """Seconds to pause for `reason` now, counted."""
        if reason == "behind":
            self.seconds["stalls_behind"] += not self.stalled
            self.stalled = True
        elif reason == "backlog":
            self.stalled = False
        self.streak = min(self.streak + 1, 16) if reason == self.last else 0
        self.last = reason
        seconds = min(PAUSE_SECONDS[reason] * 2 ** self.streak,
                      max(PAUSE_MAX_S.get(reason, 1.0), PAUSE_SECONDS[reason]))
        if reason in PAUSE_STATS:
            self.seconds[PAUSE_STATS[reason]] += seconds
        return seconds

    def yielded(self, seconds: float) -> None:
        """Time spent waiting for the learner between two forward passes (`sampler.yield_to_learner`)."""
        self.seconds[PAUSE_STATS["learner_busy"]] += seconds

    @property
    def yielded_s(self) -> float:
        return self.seconds[PAUSE_STATS["learner_busy"]]

    def generated(self) -> None:
        """The sampler generated: no stall goes on, the next pause starts short."""
        self.stalled, self.last = False, None

    def totals(self) -> dict:
        return {"paused_s": round(sum(v for k, v in self.seconds.items() if k.endswith("_s")), 1),
                **{k: round(v, 1) for k, v in self.seconds.items()}}
