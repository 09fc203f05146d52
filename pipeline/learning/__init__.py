"""The learner's step: losses, the staleness rule, admission of groups, micro-batched updates on DeepSpeed, rank links."""
