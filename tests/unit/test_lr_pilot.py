"""The learning-rate pilot's numbers and verdict (`heterorl study pilot`)."""

import json

import pytest

from lab.lr_pilot import PilotBar, choose, learning_per_100_steps, shortfalls, trade_off, write_pilot_report


def cell(d, curve, kls, steps=200, wall=400.0):
    return {"max_delay": d, "eval_curve": curve, "kl_iw_var_per_step": [[k, 0.1] for k in kls], "steps": steps,
            "accuracy_at_start": curve[0][1], "best_accuracy": max(y for _, y in curve),
            "mean_staleness_used": d / 2, "wall_seconds": wall}


def test_learning_per_100_steps_is_the_least_squares_slope_in_points():
    assert learning_per_100_steps([[0, 0.20], [100, 0.25], [200, 0.30]]) == pytest.approx(5.0)
    assert learning_per_100_steps([[0, 0.2], [100, 0.3], [200, 0.2]]) == pytest.approx(0.0)
    assert learning_per_100_steps([[0, 0.2]]) is None


def test_trade_off_takes_the_kl_quantiles_of_the_delayed_cell():
    fresh = cell(0, [[0, 0.2], [100, 0.3], [200, 0.4]], [1e-6] * 10)
    delayed = cell(64, [[0, 0.2], [200, 0.2]], [float(k) for k in range(1, 101)])  # KL 1..100
    row = trade_off(1e-4, fresh, delayed)
    assert row["kl_p50_delayed"] == pytest.approx(50.5) and row["kl_max_delayed"] == 100
    assert row["kl_p95_delayed"] == pytest.approx(95.05)   # inclusive 95th percentile of 1..100
    assert row["learning_per_100_steps"] == pytest.approx(10.0) and row["gain_points"] == pytest.approx(20.0)
    assert row["kl_p50_fresh"] == pytest.approx(1e-6) and row["seconds_per_step_fresh"] == 2.0


def row(lr, slope, kl):
    return {"lr": lr, "learning_per_100_steps": slope, "kl_p50_delayed": kl}


def test_choose_needs_the_kl_near_the_target_and_affordable_learning():
    bar = PilotBar(kl_target=1e-3, kl_tolerance=3.0, gain_points=10, affordable_steps=1000)
    rows = [row(5e-4, 8.0, 0.3),        # learns fast, KL far above the target
            row(1e-4, 2.0, 2e-3),       # KL fits, 10 points in 500 steps: qualifies
            row(5e-5, 1.2, 6e-4),       # KL fits, 10 points in 833 steps: qualifies
            row(2e-5, 0.5, 1e-4)]       # KL below the band, and 2000 steps for 10 points
    verdict = choose(rows, bar)
    assert verdict["qualifying_lrs"] == [5e-5, 1e-4] and verdict["chosen_lr"] == 1e-4
    assert choose([row(1e-4, 0.9, 1e-3), row(1e-3, -1.0, 1e-3), row(1e-5, None, 1e-3)], bar)["chosen_lr"] is None
    assert shortfalls(rows[0], bar) == ["delayed KL above the target"]
    assert shortfalls(rows[3], bar) == ["delayed KL below the target", "learns under 10 points in 1000 steps"]


def test_the_report_says_when_no_rate_meets_the_bar(tmp_path):
    fresh = cell(0, [[0, 0.2], [100, 0.21], [200, 0.22]], [1e-9] * 5)
    delayed = cell(64, [[0, 0.2], [200, 0.2]], [1e-2] * 5)
    rows = [trade_off(5e-4, fresh, delayed)]
    verdict = write_pilot_report(tmp_path, rows, "gepo", "heterorl study pilot --lrs 5e-4")
    assert verdict["chosen_lr"] is None
    md = (tmp_path / "pilot.md").read_text()
    assert "| 0.0005 | 200 | +1.0 | +2.0 | 1000 |" in md and "No rate meets both" in md
    assert "| 2.0 | delayed KL above the target |" in md  # 1e-2; and 1000 steps for 10 points is affordable
    saved = json.loads((tmp_path / "pilot.json").read_text())
    assert saved["chosen_lr"] is None and saved["trade_off"][0]["kl_p50_delayed"] == pytest.approx(1e-2)
    assert (tmp_path / "pilot.png").stat().st_size > 5000


def test_the_pilot_refuses_bad_rates_in_one_line(capsys):
    from heterorl.cli import main

    assert main(["study", "pilot", "--lrs", "fast", "--out", "/tmp/never"]) == 2
    assert "--lrs takes comma-separated learning rates, got 'fast'" in capsys.readouterr().err


def test_the_pilot_runs_each_rate_once_and_reads_its_two_cells(tmp_path, monkeypatch):
    from lab import lr_pilot

    ran = []

    def fake_study(config, losses, delays, seeds, out, overrides, data_dir, command, keep_checkpoints):
        lr = float(overrides[-1].split("=")[1])
        ran.append((lr, delays, overrides[-1]))
        assert keep_checkpoints is True  # the pilot's --keep-checkpoints reaches every cell
        out.mkdir(parents=True)
        slope = 2e4 * lr                                   # 1e-4: 2 points per 100 steps
        records = [cell(0, [[0, 0.2], [100, 0.2 + slope / 100], [200, 0.2 + 2 * slope / 100]], [1e-9] * 4),
                   cell(delays[1], [[0, 0.2], [200, 0.2]], [1e3 * lr ** 2 * 1e4] * 4)]  # KL grows as lr²
        (out / "delay_study.json").write_text(json.dumps(records))
        return 0

    monkeypatch.setattr(lr_pilot, "run_delay_study", fake_study)
    assert lr_pilot.run_lr_pilot("cfg", [1e-4, 3e-5, 1e-4], "gepo", 64, 0, tmp_path, [], "d", "cmd",
                                 keep_checkpoints=True) == 0
    assert [(lr, d) for lr, d, _ in ran] == [(1e-4, [0, 64]), (3e-5, [0, 64])] and ran[0][2] == "learner.lr=0.0001"
    saved = json.loads((tmp_path / "pilot.json").read_text())
    # KL at 64: 1e-4 -> 1e-1 (too high); 3e-5 -> 9e-3 (too high): none qualifies
    assert [r["lr"] for r in saved["trade_off"]] == [1e-4, 3e-5] and saved["chosen_lr"] is None
    assert saved["trade_off"][0]["learning_per_100_steps"] == pytest.approx(2.0)
