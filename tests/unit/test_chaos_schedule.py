"""The chaos schedule: reproducible from its seed, every fault kind present, one-off faults apart."""

from lab.chaos import chaos_schedule


def test_same_seed_same_schedule_and_every_kind_present():
    a, b, c = chaos_schedule(7, 180), chaos_schedule(7, 180), chaos_schedule(8, 180)
    assert a == b and a != c
    kinds = [e.kind for e in a]
    for kind in ("partition", "kill_learner", "restart_broker", "kill_sampler", "add_sampler", "remove_sampler"):
        assert kind in kinds
    assert [e.at_s for e in a] == sorted(e.at_s for e in a)
    assert all(0 < e.at_s < 180 for e in a)


def test_the_learner_is_killed_after_the_partition_ended_and_before_the_broker_restart():
    for minutes in (3, 15):
        events = {e.kind: e.at_s for e in chaos_schedule(0, minutes * 60, partition_s=30) if e.kind in
                  ("partition", "kill_learner", "restart_broker")}
        assert events["partition"] + 30 < events["kill_learner"] < events["restart_broker"]


def test_with_validators_one_is_killed_once_and_the_rest_is_the_same_schedule():
    plain, with_validators = chaos_schedule(3, 120), chaos_schedule(3, 120, validators=2)
    assert [e for e in with_validators if e.kind != "kill_validator"] == plain
    assert [e.kind for e in with_validators].count("kill_validator") == 1
