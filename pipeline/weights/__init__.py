"""The weight path: how policy versions travel from the learner to samplers.

`codec` turns one version into a delta against an earlier one and back, bit for bit.
"""
