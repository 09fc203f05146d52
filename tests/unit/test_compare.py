"""Comparing run directories: the figures come from the files, missing ones show as "-"."""

import json
import math

import pytest

from heterorl.compare import CompareError, compare_runs, format_table, format_value, plot_comparison


def write_run(run_dir, learner: list[dict], evals: list[dict], summary: dict | None = None,
              config: str | None = None):
    run_dir.mkdir(parents=True)
    lines = [{"kind": "learner", "time": 0.0, **r} for r in learner]
    lines += [{"kind": "eval", "time": 0.0, **r} for r in evals]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    if config is not None:
        (run_dir / "config.yaml").write_text(config)
    return run_dir


def learner_step(step: int, kl: float, iw_var: float, reward: float, used: int, dropped: int) -> dict:
    return {"step": step, "policy_version": step, "loss": -0.1, "reward_mean": reward, "kl": kl, "iw_var": iw_var,
            "iw_mean": 1.0, "clip_frac": 0.0, "groups_used": used, "groups_dropped": dropped, "staleness_mean": 0.0}


@pytest.fixture
def runs(tmp_path):
    gepo = write_run(
        tmp_path / "gepo-dir",
        learner=[learner_step(1, 0.1, 0.5, 0.2, 8, 0), learner_step(2, 0.2, 0.7, 0.4, 16, 1),
                 learner_step(3, 0.6, 0.9, 0.6, 24, 3)],
        evals=[{"step": 0, "policy_version": 0, "accuracy_sampled": 0.2, "accuracy_greedy": 0.5},
               {"step": 3, "policy_version": 3, "accuracy_sampled": 0.4, "accuracy_greedy": 0.7},
               {"step": 2, "policy_version": 2, "accuracy_sampled": 0.45, "accuracy_greedy": float("nan")}],
        summary={"run": "gepo-run", "loss_type": "gepo", "final_checkpoint": "s3://b/gepo-run/v3/",
                 "groups_used": 999, "eval_last_accuracy": 0.123})
    # A run still going: no summary.json; the loss type comes from its config.yaml.
    grpo = write_run(
        tmp_path / "grpo-live",
        learner=[learner_step(1, 0.3, 0.1, 0.1, 8, 2), learner_step(2, 0.5, 0.3, 0.3, 16, 4)],
        evals=[{"step": 0, "policy_version": 0, "accuracy_sampled": 0.2, "accuracy_greedy": 0.5}],
        config="run:\n  name: grpo-live\nlearner:\n  loss_type: grpo\n")
    # A run with only its summary's figures: no learner or eval records, no loss anywhere.
    bare = write_run(tmp_path / "bare", learner=[], evals=[],
                     summary={"eval_last_accuracy": 0.3, "eval_best_accuracy": 0.35, "groups_used": 40,
                              "groups_dropped": 2})
    return [gepo, grpo, bare]


def test_figures_come_from_metrics_first_then_summary(runs):
    gepo, grpo, bare = compare_runs(runs)
    assert gepo["run"] == "gepo-run" and gepo["loss"] == "gepo"
    assert gepo["final_accuracy"] == 0.4  # the highest policy version, not the last line written
    assert gepo["best_accuracy"] == 0.45
    assert gepo["final_greedy"] == 0.7
    assert gepo["mean_kl"] == pytest.approx(0.3)
    assert gepo["iw_var"] == pytest.approx(0.7)
    assert (gepo["groups_used"], gepo["groups_dropped"], gepo["steps"]) == (24, 3, 3)
    assert gepo["final_checkpoint"] == "s3://b/gepo-run/v3/"

    assert grpo["run"] == "grpo-live" and grpo["loss"] == "grpo"
    assert grpo["mean_kl"] == pytest.approx(0.4) and grpo["iw_var"] == pytest.approx(0.2)
    assert (grpo["final_accuracy"], grpo["best_accuracy"], grpo["final_checkpoint"]) == (0.2, 0.2, None)
    assert (grpo["groups_used"], grpo["groups_dropped"], grpo["steps"]) == (16, 4, 2)

    assert bare["run"] == "bare" and bare["loss"] is None
    assert (bare["final_accuracy"], bare["best_accuracy"]) == (0.3, 0.35)
    assert (bare["mean_kl"], bare["steps"], bare["groups_used"], bare["groups_dropped"]) == (None, None, 40, 2)


def test_a_step_logged_twice_counts_once(tmp_path):
    run = write_run(tmp_path / "redo", learner=[learner_step(1, 1.0, 0.0, 0.0, 8, 0),
                                                learner_step(2, 5.0, 0.0, 0.0, 16, 0),
                                                learner_step(2, 3.0, 0.0, 0.0, 16, 0)], evals=[])
    assert compare_runs([run])[0]["mean_kl"] == pytest.approx(2.0)


def test_table_lists_every_run_with_its_values(runs):
    table = format_table(compare_runs(runs))
    lines = table.splitlines()
    assert len(lines) == 4
    assert lines[0].split()[:4] == ["run", "loss", "final", "acc"]
    gepo_line, grpo_line, bare_line = lines[1:]
    assert gepo_line.split() == ["gepo-run", "gepo", "0.400", "0.450", "0.700", "0.300", "0.700", "24", "3", "3",
                                 "s3://b/gepo-run/v3/"]
    assert grpo_line.split() == ["grpo-live", "grpo", "0.200", "0.200", "0.500", "0.400", "0.200", "16", "4", "2",
                                 "-"]
    assert bare_line.split() == ["bare", "-", "0.300", "0.350", "-", "-", "-", "40", "2", "-", "-"]
    # Numbers are right-aligned under their header, text left-aligned.
    kl_end = lines[0].index("mean KL") + len("mean KL")
    assert [line[kl_end - 5: kl_end] for line in lines[1:]] == ["0.300", "0.400", "    -"]
    loss_start = lines[0].index("loss")
    assert [line[loss_start: loss_start + 4] for line in lines[1:]] == ["gepo", "grpo", "-   "]


def test_cell_formatting():
    assert format_value(None) == "-" and format_value(float("nan")) == "-"
    assert format_value(0.12345) == "0.123" and format_value(0.0) == "0.000"
    assert format_value(1.29e-9) == "1.29e-09"  # a tiny KL is not shown as zero
    assert format_value(3200) == "3200" and format_value("gepo") == "gepo"


def test_plot_is_written(runs, tmp_path):
    out = plot_comparison(runs, tmp_path / "plots" / "compare.png")
    assert out == tmp_path / "plots" / "compare.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_a_directory_that_is_not_a_run_is_a_one_line_error(tmp_path, runs):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError) as info:
        compare_runs([runs[0], empty])
    assert str(info.value) == f"{empty} has no metrics.jsonl (not a run directory)"
    with pytest.raises(CompareError, match="is not a directory"):
        compare_runs([tmp_path / "nope"])
    with pytest.raises(CompareError, match="not a run directory"):
        plot_comparison([empty], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_broken_summary_is_a_one_line_error(tmp_path):
    run = write_run(tmp_path / "broken", learner=[], evals=[])
    (run / "summary.json").write_text("{not json")
    with pytest.raises(CompareError, match=r"summary\.json is not valid JSON") as info:
        compare_runs([run])
    assert "\n" not in str(info.value)


def test_nan_metrics_are_skipped_not_propagated(tmp_path):
    run = write_run(tmp_path / "nan", learner=[learner_step(1, float("nan"), 0.5, 0.1, 8, 0),
                                               learner_step(2, 0.2, float("nan"), 0.1, 8, 0)],
                    evals=[{"step": 2, "policy_version": 2, "accuracy_sampled": float("nan")}])
    row = compare_runs([run])[0]
    assert row["mean_kl"] == pytest.approx(0.2) and row["iw_var"] == pytest.approx(0.5)
    assert row["final_accuracy"] is None and row["best_accuracy"] is None
    assert not any(isinstance(v, float) and math.isnan(v) for v in row.values())
