"""The weight path: how policy versions travel from the learner to samplers, and what the
learner keeps to resume (docs/weights.md).

- publish: `policy.PolicyPublisher` (a keyframe or a delta), through `publisher.BackgroundPublisher`
  on the learner's side, with the recovery state (`recovery`, `learner_state`);
- latest: the policy pointer in Redis for samplers; `recovery.latest_state` for the learner;
- fetch: `policy.fetch_policy` (the cheaper path, every tensor verified, fallback to the keyframe).

`codec` turns one version into a delta against an earlier one and back, bit for bit (pure).
"""
