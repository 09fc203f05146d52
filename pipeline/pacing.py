"""Pacing: whether a sampler should generate now, or pause and why. No I/O.

Generating costs compute, so a sampler pauses, for a named reason, when what it would
make now could not be used or has nowhere to go:

- `no_policy`: no weights loaded yet (none published, or the first download is running);
- `spool_full`: the broker has been away so long that the on-disk spool is full;
- `behind`: its weights are so far behind the learner, counting the learner steps that
  the groups already queued ahead will take, that a new group would arrive past the
  learner's max delay and be dropped (`too_far_behind`);
- `backlog`: the learner has more than `sampler.max_backlog_groups` groups to read.
The backlog is the fleet's: groups being generated (claimed prompts), spooled here, and in
the topic but not yet judged by the learner.

The sampler reads what this needs from Redis once (`pipeline.redis_state.RunView`), and
each check here is a plain function of those numbers, so it is tested without servers.
"""

from __future__ import annotations

from typing import Literal, Optional

PauseReason = Literal["no_policy", "spool_full", "behind", "backlog"]


def too_far_behind(newest_version: Optional[int], current_version: Optional[int], backlog_groups: int,
                   groups_per_step: int, max_delay_steps: int) -> bool:
    """Whether a group generated now would be past the learner's max delay when it is used.

    Its staleness at use is about (newest − current) + floor(backlog / groups_per_step):
    the versions the sampler is already behind, plus the steps the learner takes on the
    groups queued ahead of it. Past max_delay_steps the learner drops it, so generating it
    is wasted compute. (The learner's partly filled batch and versions not yet published
    are unknown here, so this can under-estimate, never over-estimate.)
    """
    if newest_version is None or current_version is None:
        return False
    ahead_steps = backlog_groups // max(1, groups_per_step)
    return (newest_version - current_version) + ahead_steps > max_delay_steps


class Pacing:
    """The pause rules of one sampler, from the learner's batch size and max delay."""

    def __init__(self, groups_per_step: int, max_delay_steps: int, max_backlog_groups: Optional[int]):
        self.groups_per_step, self.max_delay_steps = groups_per_step, max_delay_steps
        self.max_backlog_groups = max_backlog_groups

    @staticmethod
    def backlog(spooled_here: int, acked_up_to: dict[int, int], learner_offsets: dict[int, int],
                learner_unread: Optional[int] = None, in_flight: int = 0) -> int:
        """Groups ahead of the next one this sampler would make: those the fleet is still
        generating or holding in transit (`in_flight`: prompts claimed and not yet spooled,
        this sampler's included), those spooled here, and those in the topic the learner has
        not judged yet: `learner_unread` as the learner reports it, or at least what the broker
        acknowledged to us past the learner's position.

        Counting the whole fleet matters: each sampler alone sees only its own groups, so with
        many samplers the groups in flight and those acknowledged to others went uncounted,
        the queue grew past the max delay and most of it was dropped (`heterorl loadtest`,
        docs/loadtest.md)."""
        ours = sum(max(0, end - learner_offsets.get(p, 0)) for p, end in acked_up_to.items())
        return in_flight + spooled_here + max(ours, learner_unread or 0)

    def behind(self, newest: Optional[int], current: Optional[int], backlog: int) -> bool:
        return too_far_behind(newest, current, backlog, self.groups_per_step, self.max_delay_steps)

    def too_stale(self, newest: Optional[int], rollout_version: int) -> bool:
        """A finished group the learner would drop already (judged with the newest version known)."""
        return newest is not None and newest - rollout_version > self.max_delay_steps

    def pause_reason(self, *, has_policy: bool, spool_has_room: bool, newest: Optional[int],
                     current: Optional[int], backlog: int) -> Optional[PauseReason]:
        """Why not to generate now, in the order the reasons are checked; None: generate."""
        if not has_policy:
            return "no_policy"
        if not spool_has_room:
            return "spool_full"
        if self.behind(newest, current, backlog):
            return "behind"
        if self.max_backlog_groups is not None and backlog > self.max_backlog_groups:
            return "backlog"
        return None
