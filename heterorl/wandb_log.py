"""Weights & Biases for `heterorl train` (config `wandb:`, off by default): the same records as
metrics.jsonl and TensorBoard, the run's config, its summary and report.png.

The roles write metrics.jsonl (learner steps, evaluations); this logger, in the `train`
supervisor, reads the file as it grows and logs each new record once, so one W&B run holds the
whole run however many processes wrote it. Learner records are plotted against `learner/step`,
evaluations against `eval/policy_version`."""

from __future__ import annotations

import math
from pathlib import Path

import yaml

from pipeline.config import HeteroConfig, dump_config
from pipeline.errors import UserError
from pipeline.records.metrics import MetricsTail

AXES = {"learner": "step", "eval": "policy_version"}
"""Each record kind logged, and the field it is plotted against."""


def numeric_fields(record: dict, prefix: str) -> dict:
    """The record's finite numbers (and booleans as 0/1), keyed `prefix/field`."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[f"{prefix}/{key}"] = value
    return out


class WandbLogger:
    """One W&B run for one `heterorl train` run."""

    def __init__(self, cfg: HeteroConfig, run_dir: Path, run_name: str):
        try:
            import wandb
        except ImportError:
            raise UserError("wandb.enabled needs the wandb package: pip install wandb") from None
        self.wandb = wandb
        try:
            self.run = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=run_name,
                                  mode=cfg.wandb.mode, dir=str(run_dir), tags=list(cfg.wandb.tags),
                                  config=yaml.safe_load(dump_config(cfg)))
        except wandb.errors.Error as e:  # no login, no network, a bad entity: the user's to fix
            raise UserError(f"wandb: {str(e).splitlines()[0]} (or --set wandb.mode=offline)") from None
        for kind, axis in AXES.items():
            self.run.define_metric(f"{kind}/{axis}")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/{axis}")
        self.tail = MetricsTail(Path(run_dir) / "metrics.jsonl")

    def poll(self) -> int:
        """Log the records written since the last poll; returns how many."""
        logged = 0
        for record in self.tail.new_records():
            kind = record.get("kind")
            if kind in AXES and AXES[kind] in record:
                self.run.log(numeric_fields(record, kind))
                logged += 1
        return logged

    def finish(self, summary: dict, report: Path | None = None) -> None:
        """The last records, the run's summary (its numbers) and report.png, then close the run and
        wait until W&B has written it all (its offline file is complete when this returns)."""
        self.poll()
        self.run.summary.update(numeric_fields(summary, "summary"))
        if report is not None and report.exists():
            self.run.log({"report": self.wandb.Image(str(report))})
        self.run.finish()
        self.wandb.teardown()  # waits for W&B's service to write everything out before the command ends
