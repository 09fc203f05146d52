"""A recorded run under the WAN-delay model, then replay on it: the max delay held, exact
fidelity, ablations, Parquet round trip, and replay's errors.

One short real run (learner + two delayed samplers, recorded with some groups dropped) is
shared by every test of this file.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.records.metrics import read_metrics

pytestmark = [pytest.mark.integration, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
# The smoke model rarely earns a reward, so a KL term (learner vs sampler) and a high lr
# make sure training moves the weights: the fidelity check is not vacuous.
RUN_OVERRIDES = ["--set", f"learner.max_steps={STEPS}", "--set", "learner.max_delay_steps=1",
                 "--set", "learner.kl_coef=0.05", "--set", "learner.lr=5e-3", "--set", "learner.lr_warmup_steps=0",
                 "--set", "learner.sync_every=1", "--set", "sampler.max_backlog_groups=64",
                 "--set", "train.num_samplers=2",
                 # refresh only once 2 versions behind: past the max, so a sampler must stop and refresh
                 "--set", "sampler.delays.unit=steps", "--set", "sampler.delays.refresh.kind=fixed",
                 "--set", "sampler.delays.refresh.value=2",
                 # Pacing keeps a sampler from making groups a step too stale, so the recorded run's
                 # drops come from the wall-clock rule: heavy-tailed transit holds (P(> 0.8 s) 0.14).
                 # Seed 1945 holds each sampler's first group past 0.8 s (1.04 s and 1.10 s; its next
                 # seven under 1 s), so every run drops some groups (random holds once left none, in CI).
                 "--set", "sampler.delays.transit.kind=weibull", "--set", "sampler.delays.transit.shape=0.5",
                 "--set", "sampler.delays.transit.scale=0.2", "--set", "sampler.delays.seed=1945",
                 "--set", "learner.max_delay_seconds=0.8"]


@pytest.fixture(scope="module")
def recorded(local_stack, tmp_path_factory):
    """A finished training run on the session stack: (run dir, summary, config)."""
    from infra.local_stack import stack_env

    tmp = tmp_path_factory.mktemp("recorded")
    out = tmp / "run"
    cmd = [sys.executable, "-m", "heterorl", "train", "--config", "smoke", "--out", str(out),
           "--data-dir", str(tmp / "data"), *RUN_OVERRIDES]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **stack_env(local_stack)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    cfg = load_config(out / "config.yaml", [f"services.data_dir={tmp / 'data'}"], env=stack_env(local_stack))
    return out, summary, cfg


def test_the_delayed_samplers_never_fed_the_learner_past_its_max_delay(recorded):
    """No group used was more than `max_delay_steps` behind; every group read is accounted
    for; each sampler's refresh delay was waited out or cut short by a stall."""
    import re

    run_dir, summary, _ = recorded
    learner = json.loads((run_dir / "learner_summary.json").read_text())
    assert learner["final_policy_version"] == STEPS and learner["max_staleness_used"] <= 1
    steps = read_metrics(run_dir / "metrics.jsonl", "learner")
    assert len(steps) == STEPS and all(s["staleness_max"] <= 1 for s in steps)
    assert learner["groups_dropped"] == sum(learner["dropped_by_reason"].values()) > 0
    assert learner["groups_consumed"] == learner["groups_used"] + learner["groups_dropped"] + learner["malformed"]
    assert learner["groups_used"] == STEPS * 2
    for i in range(2):
        line = [x for x in (run_dir / "logs" / f"sampler-{i}.log").read_text().splitlines() if "stopped after" in x][-1]
        forced = int(re.search(r"forced_refreshes (\d+)", line).group(1))
        delayed = int(re.search(r"delayed_refreshes (\d+)", line).group(1))
        stalls = float(re.search(r"stalls_behind ([0-9.]+)", line).group(1))
        assert forced + delayed + stalls > 0, line


def _weights(uri_or_dir: str, cfg, dest: Path) -> dict:
    from safetensors.torch import load_file

    from consumers.replay import fetch_base

    path = fetch_base(cfg, uri_or_dir, dest)
    return load_file(str(path / "model.safetensors"))


def _max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _source(local_stack, summary) -> str:
    return f"kafka://{local_stack.kafka_bootstrap}/{summary['rollout_topic']}"


def _base(local_stack, summary) -> str:
    return f"s3://{local_stack.bucket}/{summary['run']}/v0/"


def test_exact_replay_reproduces_the_original_weights(recorded, local_stack, tmp_path):
    from consumers.replay import run_replay
    from pipeline.records.update_log import read_entries_file

    run_dir, summary, cfg = recorded
    original_log = read_entries_file(run_dir / "updates.jsonl")
    assert len(original_log) == STEPS
    assert sum(len(e.dropped) for e in original_log) > 0, "the recorded run should have dropped some groups"

    replay = run_replay(cfg, _source(local_stack, summary), _base(local_stack, summary), tmp_path / "exact",
                        exact_batches=True, checkpoints=f"s3://{local_stack.bucket}/replay-exact",
                        progress=False)
    assert replay["final_policy_version"] == STEPS
    assert replay["final_checkpoint"] == f"s3://{local_stack.bucket}/replay-exact/v{STEPS}/"
    assert replay["groups_used"] == summary["groups_used"]
    # The same groups in the same batches, each with its recorded staleness.
    replay_log = read_entries_file(tmp_path / "exact" / "updates.jsonl")
    assert [e.used for e in replay_log] == [e.used for e in original_log]

    original = _weights(summary["final_checkpoint"], cfg, tmp_path / "w-original")
    replayed = _weights(replay["final_checkpoint"], cfg, tmp_path / "w-replay")
    base = _weights(_base(local_stack, summary), cfg, tmp_path / "w-base")
    assert _max_abs_diff(original, base) > 1e-3  # training moved the weights...
    assert _max_abs_diff(original, replayed) < 1e-5  # ...and the replay moved them identically
    assert replay["numerics_taken"] == [] and replay["numerics_differ"] == []
    recorded_numerics = original_log[-1].numerics
    assert recorded_numerics["torch_threads"] == cfg.learner.torch_threads and recorded_numerics["machine"]


def test_a_replay_takes_the_recorded_numerics_or_names_what_differs(recorded, local_stack, tmp_path):
    """Replayed with a config whose thread count is not the recorded run's (as with the config's
    name instead of the run's saved config, docs/replay.md), it takes the recorded one and ends at
    the original's bits; with the thread count set by the user, it keeps it and says so."""
    from consumers.replay import run_replay

    run_dir, summary, cfg = recorded
    threads = cfg.learner.torch_threads
    other = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"torch_threads": threads + 1})})
    taken = run_replay(other, _source(local_stack, summary), _base(local_stack, summary), tmp_path / "taken",
                       exact_batches=True, progress=False)
    assert taken["numerics_taken"] == [f"learner.torch_threads {threads} (was {threads + 1})"]
    assert taken["numerics_differ"] == [] and taken["numerics"]["torch_threads"] == threads
    original = _weights(summary["final_checkpoint"], cfg, tmp_path / "w-original")
    assert _max_abs_diff(original, _weights(taken["final_checkpoint"], cfg, tmp_path / "w-taken")) == 0.0
    kept = run_replay(other, _source(local_stack, summary), _base(local_stack, summary), tmp_path / "kept",
                      exact_batches=True, progress=False, chosen=frozenset({"learner.torch_threads"}))
    assert kept["numerics_taken"] == [] and kept["numerics"]["torch_threads"] == threads + 1
    assert kept["numerics_differ"] == [f"learner.torch_threads: recorded {threads}, here {threads + 1} (set here)"]


def test_ablations_and_parquet_round_trip(recorded, local_stack, tmp_path):
    from consumers.replay import run_replay
    from pipeline.records.archive import export_topic
    from pipeline.trust.keyring import trusted_learner

    run_dir, summary, cfg = recorded
    # A stricter max delay drops every group the original used at staleness 1.
    strict = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"max_delay_steps": 0})})
    exact = run_replay(strict, _source(local_stack, summary), _base(local_stack, summary), tmp_path / "strict",
                       exact_batches=True, progress=False)
    original_log = [json.loads(x) for x in (run_dir / "updates.jsonl").read_text().splitlines()]
    stale_used = sum(1 for e in original_log for g in e["used"] if g["staleness"] > 0)
    assert exact["groups_dropped"] == stale_used + summary["groups_dropped"]
    assert exact["groups_used"] == summary["groups_used"] - stale_used
    assert exact["dropped_by_original"] == summary["groups_dropped"]
    assert Path(exact["final_checkpoint"], "model.safetensors").is_file()

    # Without --exact-batches, another loss, from an exported Parquet file: every group the
    # original judged is judged again, batched by groups_per_step.
    parquet = tmp_path / "run.parquet"
    export_topic(local_stack.kafka_bootstrap, summary["rollout_topic"], parquet, trusted_learner(cfg))
    gspo = cfg.model_copy(update={"learner": cfg.learner.model_copy(update={"loss_type": "gspo"})})
    free = run_replay(gspo, str(parquet), _base(local_stack, summary), tmp_path / "gspo", progress=False)
    judged = sum(len(e["used"]) + len(e["dropped"]) for e in original_log)
    assert free["loss_type"] == "gspo"
    # same max delay as the original: the original's verdicts stand
    assert free["groups_used"] + free["groups_dropped"] + free["leftover"] == judged
    assert free["groups_dropped"] == summary["groups_dropped"]
    assert free["final_policy_version"] == free["groups_used"] // cfg.learner.groups_per_step

    # From Parquet with --exact-batches: the original weights again.
    again = run_replay(cfg, str(parquet), _base(local_stack, summary), tmp_path / "parquet-exact",
                       exact_batches=True, progress=False)
    original = _weights(summary["final_checkpoint"], cfg, tmp_path / "w-original")
    assert _max_abs_diff(original, _weights(again["final_checkpoint"], cfg, tmp_path / "w-again")) < 1e-5


def test_replay_refuses_bad_sources_and_bases_in_one_line(recorded, local_stack, tmp_path, monkeypatch, capsys):
    from heterorl import cli
    from infra.local_stack import stack_env
    from pipeline.clients.topics import ensure_topic
    from pipeline.models import load_policy

    run_dir, summary, cfg = recorded
    for key, value in stack_env(local_stack).items():
        monkeypatch.setenv(key, value)
    common = ["--config", str(run_dir / "config.yaml")]

    def refused(*args) -> str:
        """`heterorl replay ...` in this process (what `python -m heterorl` runs, without a
        second start of torch): exit status 2 and one line on stderr."""
        capsys.readouterr()
        status = cli.main(["replay", *common, *args])
        stderr = capsys.readouterr().err
        assert status == 2, stderr[-2000:]
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        return lines[0]

    base = _base(local_stack, summary)
    assert "does not exist" in refused("--source", f"kafka://{local_stack.kafka_bootstrap}/no-such-topic",
                                       "--base", base, "--out", str(tmp_path / "a"))
    ensure_topic(local_stack.kafka_bootstrap, "replay-empty-topic")
    assert "is empty" in refused("--source", f"kafka://{local_stack.kafka_bootstrap}/replay-empty-topic",
                                 "--base", base, "--out", str(tmp_path / "b"))
    line = refused("--source", _source(local_stack, summary), "--base", base, "--out", str(tmp_path / "c"),
                   "--from-time", "2001-01-01T00:00:00", "--to-time", "2001-01-02T00:00:00")
    assert "no recorded group matches" in line and "holds groups created" in line

    # A base whose vocabulary differs from the one the rollouts were recorded with.
    model, tokenizer = load_policy(_weights_dir(cfg, base, tmp_path / "base"))
    model.resize_token_embeddings(model.get_input_embeddings().num_embeddings + 3)
    model.save_pretrained(tmp_path / "bigger")
    tokenizer.save_pretrained(tmp_path / "bigger")
    assert "vocabulary" in refused("--source", _source(local_stack, summary), "--base", str(tmp_path / "bigger"),
                                   "--out", str(tmp_path / "d"))
    assert "neither s3://" in refused("--source", _source(local_stack, summary), "--base", str(tmp_path / "nope"),
                                      "--out", str(tmp_path / "e"))
    assert not (tmp_path / "d" / "metrics.jsonl").exists()  # refused before any training


def _weights_dir(cfg, base: str, dest: Path) -> Path:
    from consumers.replay import fetch_base

    return fetch_base(cfg, base, dest)
