"""The rig's validator: `consumers.validator.Validator` with its model-sized checks modeled.

Real: its lease and the partition leases in Redis, reading the rollout topic, the signature
check against the key registry, which groups get which check (`GroupScreen`: probation, the
secret draw of stale groups), the signed verdicts on `<topic>.verdicts` and the progress
recorded per partition. Modeled by their time, as in the rig's learner
(`lab.loadtest.learner.ModeledScreen`): re-scoring a group's rewards
(`loadtest.reward_check_s_per_group`) and its log-probs (`loadtest.logprob_check_s_per_group`;
here a fresh group's check costs that too, there being no training forward to ride on). Run by
the rig as `python -m lab.loadtest.validator CONFIG.json VALIDATOR_ID`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from consumers.screening import GroupScreen
from consumers.validator import Validator
from lab.loadtest.learner import ModeledScreen
from pipeline.config import HeteroConfig


class ModeledValidator(Validator):
    def make_screen(self) -> GroupScreen:
        return ModeledScreen(self.cfg.security, self.cfg.loadtest)


def main(argv: list[str]) -> int:
    config, validator_id = argv
    return ModeledValidator(HeteroConfig.model_validate_json(Path(config).read_text()), validator_id).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
