"""The weight path: how a policy version travels from the learner to samplers, and what the
learner keeps to resume (docs/weights.md). One version, learner to sampler, in this folder:

- `publisher`: the learner hands each version to its publisher process (`BackgroundPublisher`),
  which writes it as a keyframe or a delta (`policy.PolicyWriter`, in the byte format of
  `codec`) into `store` (`CheckpointStore`: files, then the signed manifest, in S3; it needs no
  torch, so commands such as `heterorl status` start fast) and then sets the pointer (`store`'s
  `PolicyPointer`: the signed pointer in Redis: write, read, verify);
- `follower`: a sampler downloads the version the verified pointer names through
  `policy.fetch_policy` (every tensor checked) and swaps it in (`PolicyFollower`); the learner's
  checks re-score stale groups with past versions (`PastPolicies`); the evaluator reads the
  pointer and fetches the same way;
- `recovery` and `learner_state`: the learner's own state, to resume.

"Publish" means one thing here: the publisher's whole act, from the learner's copy to the
pointer.
"""
