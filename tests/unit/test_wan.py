"""`heterorl wan`'s pure parts: the links a user gives, the kernel shaping they become, and the
figures and targets of the report, from update logs and sampler stats made up here."""

from __future__ import annotations

import pytest

from lab.wan import (DEFAULT_LINKS, ArmResult, SamplerFigures, WanLink, check_links, learner_figures,
                     report_table, sampler_figures, tbf_args, wan_report, wan_targets)
from pipeline.config import ConfigError
from pipeline.records.update_log import DroppedGroup, UpdateEntry, UsedGroup


def test_a_link_is_read_from_its_words_and_bad_ones_are_named():
    assert WanLink.parse("C rate=10 delay=150 jitter=15 reset=120") == WanLink(
        "C", rate_mbit=10, delay_ms=150, jitter_ms=15, reset_every_s=120)
    assert WanLink.parse("A") == WanLink("A") and not WanLink("A").shaped
    assert WanLink.parse("D rate=10 join=180").join_at_s == 180
    for text, said in (("", "start with the link's name"), ("C speed=10", "unknown field 'speed'"),
                       ("C rate=fast", "rate= needs a number"), ("C rate=0", "rate= must be above 0"),
                       ("C delay=-1", "delay= must be at least 0")):
        with pytest.raises(ConfigError, match=said):
            WanLink.parse(text)


def test_the_default_links_are_the_four_of_the_rehearsal_and_unshaped_keeps_only_the_join():
    a, b, c, d = DEFAULT_LINKS
    assert not a.shaped and (b.rate_mbit, b.delay_ms) == (50, 40)
    assert (c.rate_mbit, c.delay_ms, c.reset_every_s) == (10, 150, 120)
    assert (d.rate_mbit, d.delay_ms, d.join_at_s) == (10, 150, 180)
    assert d.unshaped() == WanLink("D", join_at_s=180) and not d.unshaped().shaped


def test_links_that_cannot_make_a_run_are_refused():
    with pytest.raises(ConfigError, match="each link once"):
        check_links([WanLink("A"), WanLink("A")], minutes=10)
    with pytest.raises(ConfigError, match="at least one sampler must start with the learner"):
        check_links([WanLink("D", join_at_s=10)], minutes=10)
    with pytest.raises(ConfigError, match="join=700 s is not within the run's 10 minutes"):
        check_links([WanLink("A"), WanLink("D", join_at_s=700)], minutes=10)
    check_links(list(DEFAULT_LINKS), minutes=10)


def test_a_rate_becomes_a_token_bucket_whose_burst_keeps_it():
    assert tbf_args(10) == ["tbf", "rate", "10mbit", "burst", "32768", "latency", "200ms"]
    assert tbf_args(50)[4] == "62500"  # 10 ms of 50 Mbit/s is above the 32 KiB floor


def _entry(step: int, time: float, used=(), dropped=()) -> UpdateEntry:
    return UpdateEntry(step=step, policy_version=step, loss_type="gepo", time=time,
                       used=[UsedGroup(0, o, f"r{o}", step - 1, 1, 1.0) for o in used],
                       dropped=[DroppedGroup(0, o, f"r{o}", 0, 9, reason) for o, reason in dropped])


def test_each_samplers_groups_and_weights_are_counted_from_the_log_and_its_stats():
    links = {"A": WanLink("A"), "D": WanLink("D", rate_mbit=10, join_at_s=100)}
    ids = {"A": "run-A", "D": "run-D"}
    sender = {(0, o, f"r{o}"): "run-A" for o in range(4)} | {(0, o, f"r{o}"): "run-D" for o in range(4, 9)}
    entries = [_entry(1, 1010.0, used=[0, 1]),
               UpdateEntry(step=1, policy_version=1, loss_type="gepo", time=1011.0, kind="rewind"),
               _entry(2, 1150.0, used=[2, 4], dropped=[(5, "too_stale_steps")]),
               _entry(3, 1170.0, used=[3, 6], dropped=[(7, "failed_check:logprobs"), (8, "too_old_seconds")])]
    reports = {"run-D": {"keyframe_bytes": 270_000_000, "first_policy_bytes": 272_000_000, "first_policy_version": 7,
                         "policy_version": 10, "per_version_bytes": 3_000_000, "first_policy_at": 1130.0,
                         "stalled_behind_s": 4.0, "weights_download_s": 250.0, "first_downloads_restarted": 1},
               "run-A": {"keyframe_bytes": 270_000_000}}
    figures = sampler_figures(links, ids, {"A": 1000.0, "D": 1100.0}, 1000.0, entries, sender, reports)
    a, d = figures["A"], figures["D"]
    assert (a.sent, a.used, a.dropped_stale, a.refused, a.first_used_s, a.started_s) == (4, 4, 0, 0, 10.0, 0.0)
    assert (d.sent, d.used, d.dropped_stale, d.refused, d.first_used_s, d.started_s) == (5, 2, 2, 1, 50.0, 100.0)
    assert d.bytes_per_version == 3_000_000 and d.versions_followed == 3 and d.first_policy_bytes == 272_000_000
    assert d.first_policy_s == 30.0 and d.weights_wait_s == 34.0 and d.used_share == 0.5
    assert d.first_downloads_restarted == 1 and a.first_downloads_restarted == 0
    assert a.bytes_per_version is None and a.weights_wait_s is None  # it took no delta; no stats of its wait


def test_the_learners_pace_counts_steps_while_the_samplers_ran_and_its_busy_share():
    entries = [_entry(1, 50.0), _entry(2, 110.0), _entry(3, 170.0), _entry(4, 400.0)]
    summary = {"seconds": {"time_train_s": 150.0, "time_intake_s": 10.0, "cpu_train_s": 999.0},
               "final_policy_version": 4, "precision": "bf16"}
    pace = learner_figures(entries, 100.0, 220.0, summary, learner_wall_s=400.0)
    assert pace["steps"] == 2 and pace["steps_per_min"] == 1.0 and pace["busy_share"] == 0.4


def _arm(name: str, steps_per_min: float, samplers: dict, links) -> ArmResult:
    return ArmResult(name, f"run-{name}", links, samplers, {"steps": 10, "minutes": 10.0,
                                                          "steps_per_min": steps_per_min, "busy_share": 0.9},
                     {"lost": 0, "used_twice": 0, "unaccounted_count": 0}, model_bytes=270_000_000,
                     keyframe_bytes=192_000_000)


def test_the_targets_are_judged_against_the_unshaped_arm_and_each_link():
    links = [WanLink("A"), WanLink("C", rate_mbit=10, delay_ms=150), WanLink("D", rate_mbit=10, join_at_s=180)]
    shaped = {"A": SamplerFigures("A", "a", 0, used=40, used_share=1.0, bytes_per_version=2e6, versions_followed=10),
              "C": SamplerFigures("C", "c", 0, used=8, used_share=0.75, bytes_per_version=2e6, versions_followed=4),
              "D": SamplerFigures("D", "d", 180, used=5, used_share=0.9, first_used_s=213.0,
                                  keyframe_bytes=270_000_000)}
    flat = {k: SamplerFigures(k, k.lower(), 0) for k in "ACD"}
    targets = wan_targets(_arm("shaped", 4.5, shaped, links), _arm("unshaped", 5.0, flat, links))
    assert targets["learner_pace"] == {"value": 0.9, "target": ">= 0.9 of the unshaped arm's steps/min", "met": True}
    assert targets["bytes_per_version"]["value"] == pytest.approx(100 * 2e6 / 270e6, abs=1e-3)
    assert targets["bytes_per_version"]["met"] is True
    # D's bound is its keyframe's transfer (packed: 192 MB at 10 Mbit/s) and a minute; bytes per
    # version are a share of the model as held (270 MB).
    assert targets["first_used_D"]["met"] is True and "= 214 s" in targets["first_used_D"]["target"]
    assert targets["used_share_C"]["met"] is False and targets["used_share_D"]["met"] is True
    assert "used_share_A" not in targets  # the reference link is not held to it
    alone = wan_targets(_arm("shaped", 4.5, shaped, links), None)
    assert "learner_pace" not in alone  # nothing to compare with


def test_the_report_fails_its_audit_on_a_lost_group_or_a_volunteer_not_admitted_and_prints_a_table():
    links = [WanLink("A"), WanLink("D", rate_mbit=10, join_at_s=180)]
    samplers = {"A": SamplerFigures("A", "a", 0, sent=3, used=3), "D": SamplerFigures("D", "d", 180)}
    good = _arm("shaped", 4.0, samplers, links)
    report = wan_report([good], 10.0, "2-core test CPU")
    assert report["audit_ok"] and "learner_pace" not in report["targets"]
    table = report_table(report)
    assert "shaped (run run-shaped; policy 270.0 MB, keyframe 192.0 MB)" in table and "first_used_D" in table
    lost = _arm("shaped", 4.0, samplers, links)
    lost.audit["lost"] = 1
    assert not wan_report([lost], 10.0, "cpu")["audit_ok"]
    stranger = _arm("shaped", 4.0, samplers, links)
    stranger.volunteers_not_admitted = ["d"]
    assert not wan_report([stranger], 10.0, "cpu")["audit_ok"]


def test_a_bad_link_on_the_command_line_is_one_line_and_status_2(tmp_path, capsys):
    from heterorl.cli import main

    code = main(["wan", "--config", "demo", "--out", str(tmp_path / "wan"), "--link", "A", "--link", "C speed=3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == ["heterorl wan: error: --link 'C speed=3': unknown field 'speed'; use rate=, delay=, "
                                 "jitter=, reset=, join="]
    code = main(["wan", "--config", "demo", "--out", str(tmp_path / "wan"), "--minutes", "1", "--link", "A",
                 "--link", "D join=90"])
    assert code == 2 and "join=90 s is not within the run's 1 minutes" in capsys.readouterr().err
    assert not (tmp_path / "wan").exists()  # refused before anything started
