"""The evaluator against real servers: with `eval.after_training` it downloads each due
version as it is published and scores them all once the last one is out."""

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from heterorl.config_files import builtin_config
from pipeline.config import dump_config, load_config
from pipeline.weights.store import PolicyPointer

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _wait_for(predicate, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


def test_an_evaluator_after_training_holds_the_due_versions_and_scores_them_at_the_end(local_stack_env, tmp_path,
                                                                                       capsys):
    """... and `heterorl train`, waiting for it, shows each evaluation's progress from Redis."""
    from heterorl.train import follow_evaluator
    from pipeline.records.metrics import read_metrics
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer
    from pipeline.runtime import connect_run
    from pipeline.weights.policy import PolicyWriter

    cfg = load_config(builtin_config("smoke"), [
        f"run.name=evaluator-{uuid.uuid4().hex[:6]}", "eval.every=2", "eval.after_training=true",
        "learner.max_steps=4", "eval.problems=4", "eval.n_samples=1", "eval.greedy=false",
        f"services.data_dir={tmp_path / 'data'}", "security.require_signatures=false"])
    config = tmp_path / "config.yaml"
    config.write_text(dump_config(cfg))
    handles = connect_run(cfg)
    tokenizer = build_tokenizer()
    publisher = PolicyWriter(handles.store)
    run_dir = tmp_path / "run"
    evaluator = subprocess.Popen([sys.executable, "-m", "heterorl", "evaluator", "--config", str(config),
                                  "--out", str(run_dir)], cwd=ROOT, env=dict(os.environ),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for version in range(5):
            model_dir = tmp_path / f"v{version}"
            build_tiny_model(tokenizer, ModelSize(hidden_size=32, num_layers=1, num_heads=1, intermediate_size=64),
                             seed=version).save_pretrained(model_dir)
            tokenizer.save_pretrained(model_dir)
            PolicyPointer(handles.state).set(version, publisher.write(version, model_dir))
            if version % 2 == 0 and version < 4:  # due: downloaded, held, not scored yet
                _wait_for(lambda: (run_dir / ".evaluator" / f"v{version}").is_dir())
                time.sleep(1.0)
                assert read_metrics(run_dir / "metrics.jsonl", "eval") == []
        assert follow_evaluator(evaluator, handles.state, timeout_s=120)
        out, _ = evaluator.communicate(timeout=10)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
    assert evaluator.returncode == 0, out
    scored = read_metrics(run_dir / "metrics.jsonl", "eval")
    assert [r["policy_version"] for r in scored] == [0, 2, 4]
    assert all(0.0 <= r["accuracy_sampled"] <= 1.0 for r in scored)
    assert "v2 downloaded; scored once training ends" in out
    assert not (run_dir / ".evaluator").exists()
    assert handles.state.evaluation_progress() == {"version": 4, "done": 4, "total": 4}  # 4 problems x 1 sample
    bars = capsys.readouterr().err
    assert "v4 eval" in bars and "4/4" in bars, bars


def test_train_shows_a_bar_for_each_evaluation_the_evaluator_reports_while_it_waits(local_stack_env, tmp_path,
                                                                                     capsys):
    """`follow_evaluator` against the progress an evaluator reports in Redis: one bar per
    version, each brought to its total, none for an evaluation that ended before the wait."""
    import threading

    from heterorl.train import follow_evaluator
    from pipeline.runtime import connect_run

    cfg = load_config(builtin_config("smoke"), [f"run.name=evalbars-{uuid.uuid4().hex[:6]}",
                                                 f"services.data_dir={tmp_path / 'data'}",
                                                 "security.require_signatures=false"])
    state = connect_run(cfg).state
    state.report_evaluation(0, 10, 10)  # scored while training ran

    def evaluate():
        for version in (2, 4):
            for done in (0, 5, 10):
                state.report_evaluation(version, done, 10)
                time.sleep(1.0)  # twice the wait's poll: every report is seen
    evaluator = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(7)"])
    reports = threading.Thread(target=evaluate)
    reports.start()
    try:
        assert follow_evaluator(evaluator, state, timeout_s=60)
    finally:
        reports.join()
        evaluator.kill()
    bars = capsys.readouterr().err
    assert "v0 eval" not in bars
    assert "v2 eval" in bars and "v4 eval" in bars and bars.count("10/10") >= 2, bars
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not follow_evaluator(slow, state, timeout_s=1)  # still running at the deadline: the caller stops it
    finally:
        slow.kill()
