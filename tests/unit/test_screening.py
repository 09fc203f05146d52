"""The learner's content checks on real groups from the tiny model: its own rewards, and the
log-prob check against the version a group claims."""

import copy
import math

import numpy as np
import pytest

from consumers.screening import GroupScreen, StaleDraw, forged_used_bound
from pipeline.weights.follower import PastPolicies
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


def batch_failures(s, *groups):
    """check_batch of (group, staleness) pairs re-scored here (no step): failure kinds by group."""
    failures, in_step = s.check_batch(list(groups), fresh_in_step=False)
    assert in_step == []
    return [[k for k, _ in failures.get(r.rollout_id, [])] for r, _ in groups]


def test_honest_groups_pass_with_a_gap_of_float_noise(setup):
    s = screen(setup, probation_groups=0)
    groups = setup[3]()
    for r in groups:
        assert s.check(r, staleness=0) == []
    assert batch_failures(s, *[(r, 0) for r in groups]) == [[], [], []]
    gaps = s.summary()["logprob_gap_by_sampler"]["s"]
    assert gaps["groups"] == 3 and gaps["max"] < 1e-4 and gaps["over_threshold"] == 0
    assert gaps["min"] <= gaps["p10"] <= gaps["median"] <= gaps["p90"] <= gaps["p99"] <= gaps["max"]


def test_fresh_groups_are_left_to_the_step_when_it_can_check_them(setup):
    s = screen(setup, probation_groups=0)
    groups = setup[3]()
    for r in groups:
        s.check(r, staleness=0)
    failures, in_step = s.check_batch([(r, 0) for r in groups], fresh_in_step=True)
    assert failures == {} and in_step == [0, 1, 2] and s.counts["logprobs_checked_fresh"] == 0
    # A batch that does not reach its step leaves them planned: checked when it does.
    assert s.check_batch([(r, 0) for r in groups], fresh_in_step=True) == ({}, [0, 1, 2])
    assert s.record_fresh(groups[0], 0.5)[0] == "logprob_mismatch"
    assert s.check_batch([(r, 0) for r in groups], fresh_in_step=True) == ({}, [1, 2])


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
    s = screen(setup, probation_groups=0)
    assert s.check(r, staleness=0) == []  # found when its batch is checked
    assert batch_failures(s, (r, 0)) == [["logprob_mismatch"]]
    on_probation = screen(setup)  # ... and at once while its key is on probation
    assert [k for k, _ in on_probation.check(r, staleness=0)] == ["logprob_mismatch"]
    other = setup[3]()[2]
    other.prompt_id = "arith-train-0"
    assert [k for k, _ in screen(setup).check(other, staleness=0)] == ["prompt_mismatch"]
    other.prompt_id = "arith-train-x"
    assert [k for k, _ in screen(setup).check(other, staleness=0)] == ["unknown_prompt"]


def test_stale_groups_are_checked_only_at_the_configured_fraction(setup):
    s = screen(setup, stale_check_fraction=0.0, probation_groups=0)
    stale, fresh = setup[3]()[1], setup[3]()[2]
    for r in (stale, fresh):
        r.sampler_logps = [[-5.0] * len(c) for c in r.sampler_logps]
    s.check(stale, staleness=2)  # not drawn
    s.check(fresh, staleness=0)
    assert batch_failures(s, (stale, 2), (fresh, 0)) == [[], ["logprob_mismatch"]]
    stats = s.summary()["logprob_gap_by_sampler"]["s"]  # the calibration data counts it
    assert stats["groups"] == 1 and stats["over_threshold"] == 1 and stats["min"] == stats["max"] > 0.10


class OnePast:
    """The past versions, one model for every version."""

    def __init__(self, model, altered=()):
        self.model = model
        self.asked: list[int] = []
        self.altered = set(altered)

    def get(self, version):
        self.asked.append(version)
        return self.model

    def is_altered(self, version):
        return version in self.altered


def test_on_probation_every_stale_group_is_checked_and_an_uncheckable_one_is_not_used(setup):
    tokenizer, model, task, rollouts = setup
    security = SecurityConfig(stale_check_fraction=0.0, probation_groups=2)
    s = GroupScreen(security, task, tokenizer, 1.0, lambda: model, OnePast(model))
    honest, lying = rollouts()[0], rollouts()[1]
    lying.sampler_logps = [[-5.0] * len(c) for c in lying.sampler_logps]
    # Both checked against "v-3" as they come (on probation), although the fraction is 0.
    assert s.check(honest, staleness=3) == []
    assert [k for k, _ in s.check(lying, staleness=3)] == ["logprob_mismatch"]
    later = rollouts()[1]
    later.sampler_logps = lying.sampler_logps
    assert s.check(later, staleness=3) == []  # 2 checked: probation over, and none drawn
    assert batch_failures(s, (later, 3)) == [[]]
    blind = GroupScreen(security, task, tokenizer, 1.0, lambda: model, OnePast(None))
    assert [k for k, _ in blind.check(rollouts()[0], staleness=3)] == ["unverifiable"]


def test_past_probation_a_pruned_version_goes_unchecked_but_one_altered_in_s3_is_not_used(setup):
    """A version no longer in S3 (pruned, past the checkpoints kept) leaves its drawn groups of a
    key past probation unchecked and used, as before. One whose checkpoint is there but altered
    since the learner signed it is another matter: whoever can write to the bucket could make any
    version unverifiable that way and have its groups used unchecked. Those are not used: on
    probation or not, drawn for a check or not, stale or the validator's fresh version (its
    `current_policy` is that version, downloaded), and no key is struck for them."""
    tokenizer, model, task, rollouts = setup
    drawn = SecurityConfig(stale_check_fraction=1.0, probation_groups=0)
    pruned = GroupScreen(drawn, task, tokenizer, 1.0, lambda: model, OnePast(None))
    altered = GroupScreen(drawn, task, tokenizer, 1.0, lambda: model, OnePast(None, altered={0}))
    failures = []
    for s in (pruned, altered):
        group = rollouts()[0]
        failures.append([k for k, _ in s.check(group, staleness=3)] or batch_failures(s, (group, 3)))
    assert failures == [[[]], ["unverifiable"]]  # the altered one refused as it is read
    assert pruned.counts["logprobs_unchecked_pruned"] == 1 and "refused_unverifiable_altered" not in pruned.counts
    assert altered.counts["refused_unverifiable_altered"] == 1 and "logprobs_unchecked_pruned" not in altered.counts
    # not drawn (fraction 0), on probation, and fresh where the checker holds no current weights
    for security, staleness, current in ((SecurityConfig(stale_check_fraction=0.0, probation_groups=0), 3, model),
                                         (SecurityConfig(stale_check_fraction=0.0, probation_groups=5), 3, model),
                                         (SecurityConfig(probation_groups=0), 0, None)):
        s = GroupScreen(security, task, tokenizer, 1.0, lambda current=current: current, OnePast(None, altered={0}))
        assert [k for k, _ in s.check(rollouts()[1], staleness=staleness)] == ["unverifiable"], (security, staleness)
        assert s.checked == {} and s.counts["refused_unverifiable_altered"] == 1  # no strike, nothing judged
    # the same fresh group of a version not altered, where the checker holds no weights: planned,
    # then used unchecked in the batch (counted), as before
    s = GroupScreen(SecurityConfig(probation_groups=0), task, tokenizer, 1.0, lambda: None, OnePast(None))
    group = rollouts()[1]
    assert s.check(group, staleness=0) == [] and batch_failures(s, (group, 0)) == [[]]
    assert s.counts["logprobs_unchecked_zero3"] == 1


def test_on_probation_a_keys_first_groups_are_checked_as_read_then_fresh_ones_by_their_step(setup, monkeypatch):
    """A key's first `strikes_to_quarantine` groups are judged one by one as they are read, so a
    forger is quarantined before a batch fills with its groups; after that a fresh group costs
    no pass of its own: the step checks it before applying anything (a forged one refuses the
    step, `record_fresh` reports the failure and strikes it)."""
    s = screen(setup, probation_groups=50, strikes_to_quarantine=2)
    honest, lying = setup[3]()[0], setup[3]()[1]
    lying.sampler_logps = [[-5.0] * len(c) for c in lying.sampler_logps]
    first = setup[3]()[2]
    first.sampler_logps = lying.sampler_logps
    assert [k for k, _ in s.check(first, staleness=0, fresh_in_step=True)] == ["logprob_mismatch"]
    assert s.check(setup[3]()[0], staleness=0, fresh_in_step=True) == []
    assert s.checked["s"] == 2
    passes = []
    monkeypatch.setattr(s, "_gaps", lambda rollouts, model: passes.append(len(rollouts)) or [0.0] * len(rollouts))
    assert s.check(honest, staleness=0, fresh_in_step=True) == []
    assert s.check(lying, staleness=0, fresh_in_step=True) == []
    assert passes == []  # left to the step
    failures, in_step = s.check_batch([(honest, 0), (lying, 0)], fresh_in_step=True)
    assert failures == {} and in_step == [0, 1]
    monkeypatch.undo()
    assert s.record_fresh(lying, 4.0)[0] == "logprob_mismatch" and s.record_fresh(honest, 0.0) is None
    assert s.checked["s"] == 4  # every check counts toward the key's probation
    # where the step cannot check (ZeRO-2, or no fresh check): checked at admission, as before
    other = screen(setup, probation_groups=50)
    for _ in range(3):
        assert [k for k, _ in other.check(lying, staleness=0)] == ["logprob_mismatch"]


def test_stale_groups_are_re_scored_with_one_pass_per_version(setup, monkeypatch):
    tokenizer, model, task, rollouts = setup
    past = OnePast(model)
    s = GroupScreen(SecurityConfig(probation_groups=0, stale_check_fraction=1.0), task, tokenizer, 1.0,
                    lambda: model, past)
    groups = rollouts() + rollouts()
    for r, version in zip(groups, (4, 6, 4, 6, 4, 6)):
        r.policy_version = version
        s.check(r, staleness=8 - version)
    passes = []
    real = s._gaps
    monkeypatch.setattr(s, "_gaps", lambda rs, m: passes.append(len(rs)) or real(rs, m))
    assert batch_failures(s, *[(r, 8 - r.policy_version) for r in groups]) == [[]] * 6
    assert past.asked == [4, 6] and passes == [3, 3]


class GoneStore:
    """A checkpoint store in which every version has been pruned."""

    def manifest_key(self, version):
        return f"v{version}/manifest.json"

    def read_expected(self, *_, **__):
        from pipeline.weights.store import CheckpointNotFound

        raise CheckpointNotFound("pruned")


def test_past_versions_kept_by_the_learner_load_onto_one_model_bit_for_bit(setup, tmp_path):
    """The learner keeps its newest published versions where it runs (copies: the weights it
    trains on move on) and loads whichever is asked for onto one model, exactly, in its own
    precision; a version it no longer keeps is looked for in S3."""
    import torch

    tokenizer, model, task, rollouts = setup
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    past = PastPolicies(GoneStore(), tmp_path, tmp_path / "base", keep_last=2)
    versions = {}
    for v in (4, 6, 8):
        versions[v] = {k: (t + 0.01 * v).to(torch.bfloat16) for k, t in base.items()}  # as samplers get them
        published = {k: t.clone() for k, t in versions[v].items()}
        past.keep(v, published)
        for t in published.values():
            t.add_(1.0)  # the learner's own tensors move on; the kept copy does not
    assert sorted(past.kept) == [6, 8]
    for version in (6, 8, 6):
        got = past.get(version).state_dict()
        assert all(got[k].dtype == torch.float32 and torch.equal(got[k], versions[version][k].float()) for k in base)
    assert past.get(6) is past.get(8)  # the same model, reloaded
    assert past.get(4) is None  # neither kept nor in S3


def test_the_learner_keeps_the_newest_keep_last_versions_and_none_with_keep_last_0(setup, tmp_path):
    """What `keep` holds: the newest `keep_last` versions handed to it, each a copy of the
    tensors handed over; with `keep_last` 0 (every key the run's own, which the intake decides:
    tests/unit/test_past_policies.py) nothing."""
    import torch

    _, model, _, _ = setup
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    versions = {v: {k: (t + 0.01 * v).to(torch.bfloat16) for k, t in base.items()} for v in range(1, 6)}
    none = PastPolicies(GoneStore(), tmp_path, tmp_path / "base", keep_last=0)
    for v in versions:
        none.keep(v, versions[v])
    assert none.kept == {}
    past = PastPolicies(GoneStore(), tmp_path, tmp_path / "base", keep_last=3)
    for v in versions:
        past.keep(v, versions[v])
        assert sorted(past.kept) == list(range(max(1, v - 2), v + 1))
    assert sorted(past.kept) == [3, 4, 5]
    for v in (3, 4, 5):
        assert past.kept[v].keys() == versions[v].keys()
        assert all(torch.equal(past.kept[v][k], t) and past.kept[v][k].data_ptr() != t.data_ptr()
                   for k, t in versions[v].items())


def test_the_run_s_own_samplers_have_only_their_rewards_checked(setup, monkeypatch):
    """A trusted group (a key the run minted for a sampler it started) has its rewards re-scored
    and its claim of wrong rewards refused, but its log-probs never re-scored, fresh or stale."""
    tokenizer, model, task, rollouts = setup
    s = GroupScreen(SecurityConfig(probation_groups=50, stale_check_fraction=1.0), task, tokenizer, 1.0,
                    lambda: model, OnePast(model), trusted=lambda r: r.key_id == "local")
    passes = []
    monkeypatch.setattr(s, "_gaps", lambda rs, m: passes.append(len(rs)) or [9.0] * len(rs))
    own, stranger, wrong = rollouts()[0], rollouts()[1], rollouts()[2]
    own.key_id = wrong.key_id = "local"
    for r in (own, stranger, wrong):
        r.sampler_logps = [[-5.0] * len(c) for c in r.sampler_logps]
    wrong.rewards = [1.0 - x for x in wrong.rewards]
    assert s.check(own, staleness=3) == [] and s.check(own, staleness=0) == []
    assert [k for k, _ in s.check(wrong, staleness=0)] == ["reward_mismatch"]
    assert passes == []
    assert [k for k, _ in s.check(stranger, staleness=3)] == ["logprob_mismatch"]  # on probation: checked now
    assert s.counts["logprobs_unchecked_trusted"] == 2 and s.counts["rewards_rescored"] == 4


def test_each_stale_group_has_a_secret_draw_of_its_own(setup):
    """Not one draw per version: groups claiming one version are checked at the configured rate,
    the same group keeps its draw when judged again, and another learner (another secret) draws
    otherwise."""
    tokenizer, model, task, rollouts = setup
    s = GroupScreen(SecurityConfig(probation_groups=0, stale_check_fraction=0.5), task, tokenizer, 1.0,
                    lambda: model, OnePast(model))
    ids = [f"r{i}" for i in range(2000)]
    draws = [s.drawn("k", 7, i) for i in ids]
    assert 900 < sum(draws) < 1100  # half of one version's groups, not all or none
    assert [s.drawn("k", 7, i) for i in ids] == draws
    assert [StaleDraw(0.5)("k", 7, i) for i in ids] != draws
    assert sum(s.drawn(f"k{i}", i, "same-id") for i in range(2000)) in range(900, 1100)
    group = rollouts()[0]
    group.policy_version = 7
    s.check(group, staleness=2)
    assert (group.rollout_id in s.planned) == s.drawn(group.sampler_id, 7, group.rollout_id)


@pytest.mark.parametrize("fraction,strikes", [(0.25, 2), (0.5, 2), (0.1, 3)])
def test_the_bound_on_forged_stale_groups_used_is_the_negative_binomial_tail(fraction, strikes):
    """Against the binomial form: at most k used <=> at least `strikes` caught among the first
    k + strikes groups."""
    def used_at_most(k):
        n = k + strikes
        return 1 - sum(math.comb(n, j) * fraction ** j * (1 - fraction) ** (n - j) for j in range(strikes))

    bound = forged_used_bound(fraction, strikes, tail=1e-4)
    assert 1 - used_at_most(bound) <= 1e-4 < 1 - used_at_most(bound - 1)
    assert forged_used_bound(1.0, strikes) == 0


def test_a_forger_that_probes_a_version_then_floods_it_is_caught_at_the_configured_rate(setup):
    """The attack a per-version draw allowed: one forged group claiming v; if it is not checked,
    v was not drawn, so flood v. Every forged group is now checked with probability 1/4 on its
    own, so the flood is caught, and quarantine (2 strikes) comes within the audit's bound."""
    tokenizer, model, task, rollouts = setup
    s = GroupScreen(SecurityConfig(probation_groups=0, stale_check_fraction=0.25), task, tokenizer, 1.0,
                    lambda: model, OnePast(model))
    template = rollouts()[0]

    def forged(i):
        r = copy.deepcopy(template)
        r.rollout_id, r.key_id, r.policy_version = f"forged-{i}", "forger", 5
        r.sampler_logps = [[-5.0] * len(c) for c in r.sampler_logps]
        return r

    probes = (forged(i) for i in range(10_000))
    probe = next(p for p in probes if s.check(p, staleness=3) == [] and p.rollout_id not in s.planned)
    flood = [forged(10_000 + i) for i in range(400)]
    for r in flood:
        s.check(r, staleness=3)
    caught = [r for r in flood if r.rollout_id in s.planned]
    assert 60 < len(caught) < 140  # a quarter of the flood, where a per-version draw checked none
    failures = batch_failures(s, *[(r, 3) for r in flood])
    strikes_at = [i for i, f in enumerate(failures) if f == ["logprob_mismatch"]]
    assert len(strikes_at) == len(caught) and probe.rollout_id not in s.planned
    assert strikes_at[1] - 1 <= forged_used_bound(0.25, 2)  # used before the second strike
