"""The rig's learner: `consumers.learner.Learner` with what scales with the model modeled.

Real: reading the topic, decoding, the signature check against the key registry,
admission (staleness, duplicates, limits), strikes, the update log, the metrics, and the
weight path (the policy snapshot of the configured model, a keyframe or a delta, uploaded,
signed and announced in Redis by the background publisher; recovery states).

Modeled by their time (`loadtest.*`), because on an LLM they run on the learner's GPUs:
the optimizer step (`learner_step_s`, then `weight_change_share` of the weights changed so
the deltas have a real step's size: `ModeledStep`), re-scoring a group's rewards (its text would have to
be decoded and verified) and a stale group's log-probs (a forward pass). A fresh group's
log-prob check rides on the step's own forward passes, so it costs nothing of its own. The
learner is built with these modeled parts (`modeled_parts`); run by the rig as
`python -m lab.loadtest.learner CONFIG.json RUN_DIR`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from consumers.learner import Learner, LearnerParts
from consumers.screening import GroupScreen
from pipeline.learning.admission import RolloutLimits
from pipeline.config import HeteroConfig, LoadtestConfig, SecurityConfig
from pipeline.wire.rollout import Rollout


MODELED_POLICY = "modeled policy"
"""What the modeled screen 'scores' with: the learner's weights of any version, for the selection rule."""


class ModeledPastPolicies:
    """Every version is at hand (as `PastPolicies` for versions within the learner's reach)."""

    def is_altered(self, version: int) -> bool:
        return False

    def get(self, version: int):
        return MODELED_POLICY


class ModeledScreen(GroupScreen):
    """`GroupScreen` itself (which groups are checked: every one of staleness 0, by the step;
    every one of a key on probation, a drawn share of the rest), each stale check taking its
    modeled time and passing (the rig's samplers are honest; `heterorl attack` tests the real
    checks)."""

    def __init__(self, security: SecurityConfig, lt: LoadtestConfig):
        super().__init__(security, task=None, tokenizer=None, temperature=1.0,
                         current_policy=lambda: MODELED_POLICY, past=ModeledPastPolicies())
        self.lt = lt

    def _rescore(self, rollout: Rollout) -> list[tuple[str, str]]:
        time.sleep(self.lt.reward_check_s_per_group)
        self.counts["rewards_rescored"] += 1
        return []

    def _gaps(self, rollouts: list[Rollout], model) -> list[float]:
        time.sleep(self.lt.logprob_check_s_per_group * len(rollouts))
        return [0.0] * len(rollouts)


class ModeledStep:
    """The optimizer step by its modeled time (`loadtest.learner_step_s`), then a step's worth of
    changed weights (`weight_change_share`), so the published deltas have a real step's size."""

    def __init__(self, cfg: HeteroConfig):
        self.lt = cfg.loadtest
        self.changes = torch.Generator().manual_seed(cfg.run.seed)

    def __call__(self, engine, groups: list[Rollout], weights: list[float], lcfg, *, fresh_check=None, **_) -> dict:
        time.sleep(self.lt.learner_step_s)
        with torch.no_grad():
            for param in engine.module.parameters():
                changed = torch.rand(param.shape, generator=self.changes) < self.lt.weight_change_share
                param.add_(changed * torch.randn(param.shape, generator=self.changes).to(param.dtype) * 1e-3)
        rewards = [x for g in groups for x in g.rewards]
        return {"loss": 0.0, "reward_mean": sum(rewards) / max(1, len(rewards)),
                "sequences": sum(g.group_size for g in groups),
                "completion_tokens": float(sum(len(c) for g in groups for c in g.completion_ids)),
                "lr": lcfg.lr, **({"fresh_gaps": {i: 0.0 for i in fresh_check.groups}} if fresh_check else {})}


def modeled_parts(cfg: HeteroConfig) -> LearnerParts:
    """The learner's parts with what scales with the model modeled. The modeled groups are an
    LLM's: its vocabulary and lengths, not the small model's."""
    lt, scfg = cfg.loadtest, cfg.sampler
    return LearnerParts(step=ModeledStep(cfg), screen=ModeledScreen(cfg.security, lt),
                        limits=RolloutLimits(vocab_size=lt.vocab_size, temperature=scfg.temperature,
                                             max_new_tokens=scfg.max_new_tokens,
                                             max_positions=lt.prompt_tokens + scfg.max_new_tokens))


def main(argv: list[str]) -> int:
    config, run_dir = argv
    cfg = HeteroConfig.model_validate_json(Path(config).read_text())
    return Learner(cfg, Path(run_dir), modeled_parts(cfg)).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
