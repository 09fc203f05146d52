"""The learner's content checks on real groups from the tiny model: its own rewards, and the
log-prob check against the version a group claims."""

import numpy as np
import pytest

from consumers.screening import GroupScreen, PastPolicies
from pipeline.config import SecurityConfig
from pipeline.models import sample_groups
from pipeline.models.tiny import build_tiny_model, build_tokenizer
from pipeline.tasks import make_task
from producers.sampler import score_groups


@pytest.fixture(scope="module")
def setup():
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0).eval()
    task = make_task("arithmetic")
    problems = [task.train_problem(i) for i in range(3)]
    groups = sample_groups(model, tokenizer, [task.encode_prompt(p, tokenizer) for p in problems], group_size=4,
                           temperature=1.0, max_new_tokens=5, seed=1)
    rollouts = lambda: score_groups(task, tokenizer, problems, groups, sampler_id="s", policy_version=0,  # noqa: E731
                                    sampling={"temperature": 1.0})
    return tokenizer, model, task, rollouts


def screen(setup, **security):
    tokenizer, model, task, _ = setup
    return GroupScreen(SecurityConfig(**security), task, tokenizer, 1.0, lambda: model, None)


def test_honest_groups_pass_with_a_gap_of_float_noise(setup):
    s = screen(setup)
    for r in setup[3]():
        assert s.check(r, staleness=0) == []
    gaps = s.summary()["logprob_gap_by_sampler"]["s"]
    assert gaps["groups"] == 3 and gaps["max"] < 1e-4 and gaps["over_threshold"] == 0
    assert gaps["min"] <= gaps["p10"] <= gaps["median"] <= gaps["p90"] <= gaps["p99"] <= gaps["max"]


def test_forged_rewards_are_replaced_by_the_verifiers_and_reported(setup):
    r = setup[3]()[0]
    honest = list(r.rewards)
    r.rewards = [1.0] * r.group_size
    assert honest != [1.0] * 4  # an untrained model does not solve them all
    failures = screen(setup).check(r, staleness=0)
    assert [k for k, _ in failures] == ["reward_mismatch"]
    assert r.rewards == honest  # the learner trains on its own


def test_noisy_logprobs_fail_the_check_and_a_wrong_prompt_is_caught(setup):
    r = setup[3]()[1]
    rng = np.random.default_rng(0)
    r.sampler_logps = [np.minimum(np.asarray(c) + rng.normal(0, 0.5, len(c)), 0).tolist() for c in r.sampler_logps]
    failures = screen(setup).check(r, staleness=0)
    assert [k for k, _ in failures] == ["logprob_mismatch"]
    other = setup[3]()[2]
    other.prompt_id = "arith-train-0"
    assert [k for k, _ in screen(setup).check(other, staleness=0)] == ["prompt_mismatch"]
    other.prompt_id = "arith-train-x"
    assert [k for k, _ in screen(setup).check(other, staleness=0)] == ["unknown_prompt"]


def test_stale_groups_are_checked_only_at_the_configured_fraction(setup):
    s = screen(setup, stale_logprob_check_fraction=0.0, probation_groups=0)
    r = setup[3]()[1]
    r.sampler_logps = [[-5.0] * len(c) for c in r.sampler_logps]
    assert s.check(r, staleness=2) == []  # not drawn
    assert s.check(r, staleness=0)[0][0] == "logprob_mismatch"
    stats = s.summary()["logprob_gap_by_sampler"]["s"]  # the calibration data counts it
    assert stats["groups"] == 1 and stats["over_threshold"] == 1 and stats["min"] == stats["max"] > 0.10


class OnePast:
    """The checkpoint store of past versions, holding one model for every version."""

    def __init__(self, model):
        self.model = model

    def get(self, version):
        return self.model


def test_on_probation_every_stale_group_is_checked_and_an_uncheckable_one_is_not_used(setup):
    tokenizer, model, task, rollouts = setup
    security = SecurityConfig(stale_logprob_check_fraction=0.0, probation_groups=2)
    s = GroupScreen(security, task, tokenizer, 1.0, lambda: model, OnePast(model))
    honest, lying = rollouts()[0], rollouts()[1]
    lying.sampler_logps = [[-5.0] * len(c) for c in lying.sampler_logps]
    assert s.check(honest, staleness=3) == []  # checked against "v-3": passes
    assert s.check(lying, staleness=3)[0][0] == "logprob_mismatch"  # caught although the fraction is 0
    assert s.check(rollouts()[2], staleness=3) == []  # 2 checked: probation over
    assert s.check(lying, staleness=3) == []  # now only drawn ones are checked (fraction 0)
    blind = GroupScreen(security, task, tokenizer, 1.0, lambda: model, OnePast(None))
    assert blind.check(rollouts()[0], staleness=3)[0][0] == "unverifiable"


class NoStore:
    """A checkpoint store that must not be read."""

    def manifest_key(self, version):
        return f"v{version}/manifest.json"

    def fetch(self, *_, **__):
        raise AssertionError("downloaded a version the learner handed over")


def test_the_learners_own_versions_are_checked_without_a_download(setup, tmp_path):
    """What the learner publishes it keeps for re-scoring (`remember`): a stale group of that
    version is checked against exactly those weights, and the oldest is let go past capacity."""
    tokenizer, model, task, rollouts = setup
    past = PastPolicies(NoStore(), tmp_path, capacity=2)
    for version in (4, 6, 8):
        model.save_pretrained(tmp_path / f"v{version}")
        tokenizer.save_pretrained(tmp_path / f"v{version}")
        past.remember(version, tmp_path / f"v{version}")
    assert list(past.models) == [6, 8]
    s = GroupScreen(SecurityConfig(probation_groups=10), task, tokenizer, 1.0, lambda: model, past)
    honest, lying = rollouts()[0], rollouts()[1]
    honest.policy_version = lying.policy_version = 6
    lying.sampler_logps = [[-5.0] * len(c) for c in lying.sampler_logps]
    assert s.check(honest, staleness=2) == []
    assert s.check(lying, staleness=2)[0][0] == "logprob_mismatch"
    assert s.summary()["logprob_gap_by_sampler"]["s"]["max"] > 0.10


def test_a_kept_version_is_a_copy_the_learners_next_steps_do_not_change(setup, tmp_path):
    import torch

    tokenizer, model, task, rollouts = setup
    past = PastPolicies(NoStore(), tmp_path, capacity=2)
    learner = build_tiny_model(tokenizer, seed=0)
    past.remember(2, tmp_path / "not-read", module=learner)  # taken from the model, not the directory
    kept = past.get(2)
    before = {k: v.clone() for k, v in kept.state_dict().items()}
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(1.0)  # the learner's next step
    assert all(torch.equal(before[k], v) for k, v in kept.state_dict().items())
    assert not any(p.requires_grad for p in kept.parameters())
