"""The delay study's report: the paper-shaped table and its derived numbers."""

import json
import shutil
from pathlib import Path

import pytest

from lab.study import write_report


def record(loss, d, best, last):
    return {"loss": loss, "max_delay": d, "seed": 1, "run": f"study-{loss}-d{d}", "accuracy_at_start": 0.2,
            "best_accuracy": best, "last_accuracy": last, "eval_curve": [[0, 0.2], [50, best], [100, last]],
            "max_staleness_used": d, "mean_staleness_used": d / 2, "staleness_histogram": {"0": 5, str(d): 3},
            "groups_used": 6400, "groups_dropped": 10 * d, "mean_learner_sampler_kl": 1e-3 * (d + 1),
            "mean_iw_variance": 1e-2 * (d + 1), "mean_clip_fraction": 0.05,
            "kl_iw_var_per_step": [[1e-4 * (d + 1) * k, 1e-2 * (d + 1)] for k in range(1, 21)],
            "wall_seconds": 60.0, "eval_samples": 8, "eval_problems": 200, "groups_generated": 7000,
            "sampler_stalls": 3, "forced_refreshes": 2, "steps": 100, "mean_completion_tokens": 40.0,
            "weight_variances_per_step": [[1e-3 * (d + 1), 0.3, 0.2, 0.1], [2e-3 * (d + 1), 0.6, 0.4, 0.2]]}


def test_report_table_gap_and_degradation(tmp_path):
    records = [record("gepo", 0, 0.50, 0.48), record("gepo", 16, 0.45, 0.40),
               record("grpo", 0, 0.52, 0.30), record("grpo", 16, 0.40, 0.20)]
    write_report(tmp_path, records, ["gepo", "grpo"], [0, 16], "heterorl study delay --quick")
    md = (tmp_path / "delay_study.md").read_text()
    assert "| loss | delay 0 Best | delay 0 Last | delay 16 Best | delay 16 Last |" in md
    assert "| gepo | 50.0 | 48.0 | 45.0 | 40.0 |" in md
    assert "| grpo | 52.0 | 30.0 | 40.0 | 20.0 |" in md
    assert "| gepo | 2.0 | 5.0 | 3.5 |" in md   # best-to-last gap per max delay, then their mean
    assert "| grpo | 22.0 | 20.0 | 21.0 |" in md
    assert "from max delay 0 to 16: 8.0 points" in md
    # GEPO's Last at 16 (40.0) is 20 % below its Best at 0 (50.0)
    assert "is 20.0 % below its Best at max delay 0 (bar: under 3 %): does not hold" in md
    assert json.loads((tmp_path / "delay_study.json").read_text()) == records
    for png in ("accuracy_curves.png", "iw_variance_vs_kl.png", "staleness_histogram.png", "kl_and_iw_variance.png",
                "weight_families_vs_kl.png"):
        assert (tmp_path / png).stat().st_size > 5000
    assert "8 samples per problem, 200 problems" in md
    # max delay 0: KL p50, p95 (inclusive: 1.905e-3) and max over the steps' 1e-4..2e-3, clip fraction, IW variance
    assert "| 1.05e-03 | 1.91e-03 | 2.00e-03 | 0.050 | 1.00e-02 |" in md


def test_a_written_analysis_survives_regeneration(tmp_path):
    from lab.study import ANALYSIS_MARKER

    records = [record("gepo", 0, 0.5, 0.5)]
    write_report(tmp_path, records, ["gepo"], [0], "cmd")
    md = tmp_path / "delay_study.md"
    md.write_text(md.read_text() + "We conclude that the test works.\n")
    write_report(tmp_path, records + [record("gepo", 16, 0.4, 0.4)], ["gepo"], [0, 16], "cmd")
    text = md.read_text()
    assert text.count(ANALYSIS_MARKER) == 1 and text.endswith("We conclude that the test works.\n")
    assert "| gepo | 50.0 | 50.0 | 40.0 | 40.0 |" in text


def test_a_finished_cell_is_reused_only_with_the_same_settings():
    from lab.study import _same_cell

    text = "# the seed's settings\nlearner:\n  lr: 1.0e-5\n  max_steps: 100\n"
    recorded = {"config": "configs/study.yaml", "config_text": text, "loss": "gepo", "max_delay": 4, "seed": 1,
                "overrides": ["learner.lr=1e-06"]}
    assert _same_cell(recorded, {**recorded, "config": "/elsewhere/heterorl/configs/study.yaml"})  # moved file
    frozen = "# frozen at the pilot's rate\nlearner:\n  lr: 1.0e-6   # the seed's\n  max_steps: 100\n"
    assert _same_cell(recorded, {**recorded, "config_text": frozen, "overrides": []})  # set in the file, not by --set
    assert not _same_cell(recorded, {**recorded, "overrides": []})  # lr 1e-5
    assert not _same_cell(recorded, {**recorded, "overrides": ["learner.lr=1e-06", "learner.max_steps=50"]})
    assert not _same_cell(recorded, {**recorded, "config_text": text.replace("100", "101")})
    assert not _same_cell(recorded, {**recorded, "seed": 2})
    assert not _same_cell(recorded, {**recorded, "loss": "gspo"})
    assert not _same_cell({**recorded, "config_text": "learner: [unclosed\n"}, recorded)  # unreadable record: run again


def test_seed_spread_and_the_two_claims():
    from lab.study import _bars, claims

    records = [{**record("gepo", 0, 0.50, 0.50), "seed": 1}, {**record("gepo", 0, 0.60, 0.56), "seed": 2},
               {**record("gepo", 64, 0.54, 0.54), "seed": 1}, {**record("gepo", 64, 0.55, 0.53), "seed": 2},
               {**record("gspo", 64, 0.60, 0.50), "seed": 1}, {**record("gspo", 64, 0.60, 0.40), "seed": 2}]
    c = claims(records, [0, 64])
    assert abs(c["gepo_drop_pct"] - 100 * (0.55 - 0.535) / 0.55) < 1e-9  # mean Best at 0 vs mean Last at 64
    assert abs(c["gepo_gap"] - 1.0) < 1e-9 and abs(c["gspo_gap"] - 15.0) < 1e-9
    assert abs(c["gap_reduction_pct"] - 100 * (1 - 1.0 / 15.0)) < 1e-9
    assert claims(records[:4], [0, 64])["gap_reduction_pct"] is None  # no GSPO cell: not claimed either way
    tiny = records[:4] + [{**record("gspo", 64, 0.600, 0.597), "seed": 1}, {**record("gspo", 64, 0.6, 0.6), "seed": 2}]
    assert abs(claims(tiny, [0, 64])["gspo_gap"] - 0.15) < 1e-9
    assert claims(tiny, [0, 64])["gap_reduction_pct"] is None  # a 0.15-point gap: nothing to be 85 % smaller than
    # a seed run at max delay 0 only does not enter the bar: Best at 0 is seed 1's alone, as Last at 64 is
    unpaired = records[:3]
    c = claims(unpaired, [0, 64])
    assert abs(c["gepo_drop_pct"] - 100 * (0.50 - 0.54) / 0.50) < 1e-9
    assert _bars(c)[0].endswith("holds (on seed 1: the seeds with both cells).")
    # every seed paired: nothing to say about pairing; over two seeds the mean is no verdict, the interval is
    assert _bars(claims(records[:4], [0, 64]))[0].endswith(
        ": under the bar on the mean of the seeds; the verdict, with its interval over them, is the next section's.")


def test_the_report_shows_the_range_over_seeds(tmp_path):
    records = [{**record("gepo", 0, 0.50, 0.50), "seed": 1}, {**record("gepo", 0, 0.60, 0.56), "seed": 2}]
    write_report(tmp_path, records, ["gepo"], [0], "cmd")
    md = (tmp_path / "delay_study.md").read_text()
    assert "| gepo | 55.0 (50.0–60.0) | 53.0 (50.0–56.0) |" in md
    assert "| gepo | 2.0 (0.0–4.0) | 2.0 |" in md
    assert "same base model (20.0 %)" in md  # one start accuracy: no range


def test_the_report_names_the_base_models_range_when_seeds_evaluate_it_differently(tmp_path):
    records = [{**record("gepo", 0, 0.50, 0.50), "seed": 0, "accuracy_at_start": 0.095},
               {**record("gepo", 0, 0.60, 0.56), "seed": 1, "accuracy_at_start": 0.090}]
    write_report(tmp_path, records, ["gepo"], [0], "cmd")
    md = (tmp_path / "delay_study.md").read_text()
    assert "same base model (9.2 %; 9.0–9.5 % on the seeds' own evaluation draws)" in md


def test_the_long_study_design_is_fixed_in_its_config():
    from heterorl.config_files import config_path
    from pipeline.config import load_config

    cfg = load_config(config_path("long_study"))
    assert (cfg.study.losses, cfg.study.max_delays, cfg.study.seeds) == (["gepo", "gspo", "grpo"], [0, 16, 64], [0, 1])
    assert cfg.task.name == "scratchpad_sum" and cfg.learner.kl_coef == 0.005 and cfg.learner.max_steps >= 400
    assert cfg.sampler.delays.refresh.kind == "lognormal" and cfg.sampler.delays.refresh.upper == 64
    assert load_config(config_path("study")).study.max_delays == [0, 4, 16, 64]  # the first study's default grid


def test_the_noise_robust_view_averages_consecutive_evaluations(tmp_path):
    from lab.study import _smoothed

    noisy = {**record("gepo", 64, 0.0, 0.0), "eval_curve": [[0, 0.2], [25, 0.5], [50, 0.3], [75, 0.4], [100, 0.2]]}
    s = _smoothed(noisy)  # averages of 3: 0.333, 0.4, 0.3
    assert abs(s["best_accuracy"] - 0.4) < 1e-12 and abs(s["last_accuracy"] - 0.3) < 1e-12
    assert _smoothed({**noisy, "eval_curve": [[0, 0.2], [25, 0.5]]})["best_accuracy"] == 0.0  # too short: as is
    records = [{**record("gepo", 0, 0.5, 0.5), "eval_curve": [[0, 0.2], [50, 0.5], [100, 0.5], [150, 0.5]]}, noisy,
               {**record("gspo", 64, 0.6, 0.2), "eval_curve": [[0, 0.2], [50, 0.6], [100, 0.2], [150, 0.2]]}]
    write_report(tmp_path, records, ["gepo", "gspo"], [0, 64], "cmd")
    md = (tmp_path / "delay_study.md").read_text()
    view = md[md.index("## The same on a 3-evaluation moving average"):]
    # GEPO at 64: 40.0 − 30.0; GSPO at 64: max(0.333, 0.333) − 0.333 = 0
    assert "| gepo | 0.0 | 10.0 | 5.0 |" in view and "| gspo | – | 0.0 | 0.0 |" in view
    assert "is 40.0 % below its Best at max delay 0" in view  # Last 0.3 vs Best 0.5


def test_best_and_last_as_means_of_the_last_evaluations_when_the_study_says_so(tmp_path):
    curve0 = [[0, 0.1], [75, 0.34], [100, 0.36], [125, 0.38], [150, 0.37]]
    curve16 = [[0, 0.1], [75, 0.30], [100, 0.33], [125, 0.35], [150, 0.36]]
    records = [{**record("gepo", 0, 0.38, 0.37), "eval_curve": curve0, "mean_staleness_used": 0.0},
               {**record("gepo", 16, 0.36, 0.36), "eval_curve": curve16, "mean_staleness_used": 5.0}]
    write_report(tmp_path, records, ["gepo"], [0, 16], "cmd", averaged=3)
    md = (tmp_path / "delay_study.md").read_text()
    assert "Best = the highest mean of 3 consecutive evaluations, Last = the mean of the final 3" in md
    # max delay 0: windows 0.267, 0.36, 0.37 -> Best 37.0, Last 37.0; 16: Best = Last = 34.7
    assert "| gepo | 37.0 | 37.0 | 34.7 | 34.7 |" in md
    assert "moving average" not in md  # the averaged view is the report itself
    stored = json.loads((tmp_path / "delay_study.json").read_text())
    assert [r["evaluations_averaged"] for r in stored] == [3, 3]
    assert stored[1]["last_accuracy"] == pytest.approx((0.33 + 0.35 + 0.36) / 3)
    verdict = json.loads((tmp_path / "delay_verdict.json").read_text())
    # at matched age Last's versions 100, 125, 150 less 5 meet max delay 0 at 95, 120, 145
    matched = (0.356 + 0.376 + 0.372) / 3
    assert verdict["matched_age"][0]["per_seed_pct"] == pytest.approx([100 * (matched - (0.33 + 0.35 + 0.36) / 3)
                                                                        / matched])


def test_the_late_slope_tells_a_plateau_from_a_collapse():
    from lab.study import late_slope

    curve = [[x, 0.2 + 0.001 * x] for x in range(0, 300, 25)]  # rising 10 points per 100 steps ...
    plateau = {"eval_curve": curve + [[x, 0.5] for x in range(300, 425, 25)]}  # ... then flat
    collapse = {"eval_curve": curve + [[x, 0.5 - 0.002 * (x - 300)] for x in range(300, 425, 25)]}
    assert abs(late_slope(plateau)) < 1e-9
    assert abs(late_slope(collapse) - (-20.0)) < 1e-9   # 0.2 per 100 steps = 20 points
    assert late_slope({"eval_curve": [[0, 0.2], [400, 0.5]]}) is None  # too few evaluations to say


def test_the_last_quarters_share_of_the_gain_says_whether_a_curve_has_flattened():
    from lab.study import last_quarter_share

    # the plateau pilot's max-delay-0 curve: at 112.5 halfway between 35.0 and 38.0, so the last
    # quarter adds 39.75 - 36.5 = 3.25 of the 30.5 points gained
    pilot = {"eval_curve": [[v, a / 100] for v, a in zip(range(0, 175, 25), [9.25, 21.5, 30.75, 31.75, 35.0, 38.0, 39.75])]}
    assert last_quarter_share(pilot) == pytest.approx(3.25 / 30.5)
    # a straight line adds a quarter of its gain in its last quarter, whatever the evaluations
    assert last_quarter_share({"eval_curve": [[0, 0.1], [75, 0.25], [150, 0.4]]}) == pytest.approx(0.25)
    assert last_quarter_share({"eval_curve": [[0, 0.3], [150, 0.2]]}) is None  # no gain to share
    assert last_quarter_share({"eval_curve": [[0, 0.3]]}) is None


@pytest.mark.parametrize("name, delays", [("seed_regime", [0, 32, 64]), ("smollm2_study", [0, 32])])
def test_the_seed_regime_configs_carry_the_seed_systems_settings(name, delays):
    """As HanlardResearch/Hetero-RL set them: T 0.6, top-p 0.95, top-k 20, 8 completions per
    prompt, no std scaling, clip 0.2 for every loss, k3 penalty 0.005, max_diff_step 32."""
    from heterorl.config_files import config_path
    from pipeline.config import load_config

    cfg = load_config(config_path(name))
    s, learner = cfg.sampler, cfg.learner
    assert (s.temperature, s.top_p, s.top_k, s.group_size) == (0.6, 0.95, 20, 8)
    assert not learner.scale_adv_by_std and (learner.epsilon_low, learner.epsilon_high) == (0.2, 0.2)
    assert learner.kl_coef == 0.005 and 32 in cfg.study.max_delays and cfg.study.max_delays == delays
    assert learner.lr_warmup_steps == round(0.03 * learner.max_steps)   # the seed's 3 % warm-up
    assert s.delays.refresh.kind == "lognormal" and cfg.study.losses == ["gepo", "gspo", "grpo"]


def test_quick_runs_the_smallest_delay_and_the_largest_that_can_bind_in_50_steps():
    from lab.study import quick_max_delays

    assert quick_max_delays([0, 4, 16, 64]) == [0, 16]       # `study`
    assert quick_max_delays([0, 32, 64]) == [0, 32]          # `seed_regime`
    assert quick_max_delays([0]) == [0] and quick_max_delays([64]) == [64]


def test_report_only_reports_the_finished_cells_and_starts_nothing(tmp_path, monkeypatch):
    """Cells run apart and gathered into DIR/cells/ make a report of their own; the grid's
    missing cells show as "–" and nothing is run (no stack, no cell)."""
    from lab import study
    from heterorl.config_files import config_path

    grid = Path(__file__).parents[2] / "docs/results/smollm2_study/grid/cells"
    for name in ("gepo-d0-s0", "gepo-d32-s0"):
        shutil.copytree(grid / name, tmp_path / "cells" / name)
    monkeypatch.setattr(study, "run_supervisor", lambda *a, **k: pytest.fail("--report-only ran a cell"))
    monkeypatch.setattr(study, "services_for_run", lambda *a, **k: pytest.fail("--report-only started a stack"))
    assert study.run_delay_study(config_path("smollm2_study"), ["gepo", "gspo"], [0, 32], [0], tmp_path, [],
                                 str(tmp_path / "data"), "cmd", report_only=True) == 0
    table = (tmp_path / "delay_study.md").read_text()
    assert "| gepo | 30.2 | 30.2 | 25.5 | 25.5 |" in table and "| gspo | – | – | – | – |" in table
    records = json.loads((tmp_path / "delay_study.json").read_text())
    assert [(r["loss"], r["max_delay"]) for r in records] == [("gepo", 0), ("gepo", 32)]
    shutil.rmtree(tmp_path / "cells" / "gepo-d0-s0")  # one cell: nothing to compare it with yet
    assert study.run_delay_study(config_path("smollm2_study"), ["gepo", "gspo"], [0, 32], [0], tmp_path, [],
                                 str(tmp_path / "data"), "cmd", report_only=True) == 0
    assert "- Not yet computable: they need GEPO's cells at max delays 0 and 32." in \
        (tmp_path / "delay_study.md").read_text()


def test_report_only_on_a_directory_without_finished_cells_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from lab import study
    from heterorl.config_files import config_path

    monkeypatch.setattr(study, "services_for_run", lambda *a, **k: pytest.fail("--report-only started a stack"))
    assert study.run_delay_study(config_path("smollm2_study"), ["gepo"], [0], [0], tmp_path, [],
                                 str(tmp_path / "data"), "cmd", report_only=True) == 1
    assert f"heterorl study: no finished cell of this grid in {tmp_path}/cells/ to report" in capsys.readouterr().err
    assert not (tmp_path / "delay_study.md").exists()
