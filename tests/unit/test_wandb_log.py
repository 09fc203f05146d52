"""The W&B logger of `heterorl train`, in W&B's offline mode: every record of metrics.jsonl logged
once, against its own axis, with the run's config (no secrets), summary and report."""

import json
import sys

import pytest

from heterorl.wandb_log import WandbLogger, numeric_fields
from pipeline.config import HeteroConfig
from pipeline.errors import UserError


def write(path, *records):
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_numeric_fields_keep_finite_numbers_only():
    assert numeric_fields({"kind": "eval", "step": 3, "acc": 0.5, "nan": float("nan"), "ok": True, "s": "x"},
                          "eval") == {"eval/step": 3, "eval/acc": 0.5, "eval/ok": 1}


def test_records_config_summary_and_report_reach_an_offline_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = HeteroConfig.model_validate({"wandb": {"enabled": True, "mode": "offline", "tags": ["test"]},
                                       "services": {"s3_secret_key": "do-not-log-me"}})
    metrics = tmp_path / "metrics.jsonl"
    logger = WandbLogger(cfg, tmp_path, "run-1")
    write(metrics, {"kind": "eval", "step": 0, "policy_version": 0, "accuracy_sampled": 0.1},
          {"kind": "learner", "step": 1, "loss": 0.5, "staleness_mean": 0.0})
    assert logger.poll() == 2
    write(metrics, {"kind": "learner", "step": 2, "loss": 0.25, "staleness_mean": 1.0})
    with open(metrics, "a") as f:
        f.write('{"kind": "learner", "step": 3')  # a line still being written waits for the next poll
    assert logger.poll() == 1 and logger.poll() == 0
    assert logger.run.summary["learner/loss"] == 0.25 and logger.run.summary["eval/accuracy_sampled"] == 0.1
    assert logger.run.config["learner"]["loss_type"] == cfg.learner.loss_type
    assert logger.run.config["services"]["s3_secret_key"] is None

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.plot([0, 1]); plt.savefig(tmp_path / "report.png"); plt.close()
    logger.finish({"eval_accuracy_after": 0.4, "run": "run-1"}, tmp_path / "report.png")
    [stored] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    data = stored.read_bytes()
    for key in (b"learner/loss", b"eval/policy_version", b"summary/eval_accuracy_after", b"report"):
        assert key in data, key
    assert b"do-not-log-me" not in data


def test_without_the_package_a_user_gets_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = HeteroConfig.model_validate({"wandb": {"enabled": True, "mode": "offline"}})
    with pytest.raises(UserError, match="pip install wandb"):
        WandbLogger(cfg, tmp_path, "run-1")


def test_online_without_a_login_is_one_line(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))  # no stored login
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    cfg = HeteroConfig.model_validate({"wandb": {"enabled": True}})
    with pytest.raises(UserError, match="wandb.mode=offline"):
        WandbLogger(cfg, tmp_path, "run-1")
