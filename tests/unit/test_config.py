"""Typed config: every shipped file loads, mistakes fail at load time naming the field."""

import pytest

from heterorl.config_files import builtin_config, builtin_configs
from pipeline.config import ConfigError, HeteroConfig, LossType, dump_config, load_config


def test_the_shipped_configs_are_found():
    assert builtin_configs() == ["dataset_example", "demo", "loadtest", "long_study", "seed_regime", "smoke",
                                 "smollm2", "smollm2_plateau", "smollm2_study", "study"]


@pytest.mark.parametrize("name", builtin_configs())
def test_every_shipped_config_loads(name):
    cfg = load_config(builtin_config(name), env={})
    assert isinstance(cfg, HeteroConfig)


def test_loss_type_typo_fails_at_load(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("learner:\n  loss_type: gepoo\n")
    with pytest.raises(ConfigError, match=r"learner\.loss_type"):
        load_config(f, env={})


def test_unknown_key_is_rejected_and_named(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("sampler:\n  group_sise: 4\n")
    with pytest.raises(ConfigError, match=r"sampler\.group_sise: unknown field"):
        load_config(f, env={})


def test_a_renamed_field_names_its_new_name():
    with pytest.raises(ConfigError, match=r"security.stale_logprob_check_fraction: renamed "
                                          r"security.stale_version_check_fraction in 0.2.0 .*\), then "
                                          r"security.stale_check_fraction in 0.3.0"):
        load_config(None, ["security.stale_logprob_check_fraction=0.5"])
    with pytest.raises(ConfigError, match=r"security.stale_version_check_fraction: renamed "
                                          r"security.stale_check_fraction in 0.3.0 \(a secret draw for every group"):
        load_config(None, ["security.stale_version_check_fraction=0.5"])


def test_bounds_are_checked():
    with pytest.raises(ConfigError, match=r"learner\.max_delay_steps"):
        load_config(None, ["learner.max_delay_steps=-1"], env={})


def test_overrides_parse_yaml_scalars():
    cfg = load_config(None, ["learner.lr=3e-4", "learner.stale_policy=reweight", "eval.problems=null"], env={})
    assert cfg.learner.lr == pytest.approx(3e-4)
    assert cfg.learner.stale_policy == "reweight"
    assert cfg.eval.problems is None


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(None, ["learner.lr"], env={})


def test_service_urls_come_from_environment_unless_configured():
    env = {"KAFKA_BOOTSTRAP_SERVERS": "k:9092", "REDIS_URL": "redis://r:6379/0", "AWS_ENDPOINT_URL": "http://s:9000",
           "AWS_ACCESS_KEY_ID": "id", "AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}
    cfg = load_config(None, ["services.redis_url=redis://other:1/0"], env=env)
    assert cfg.services.kafka_bootstrap == "k:9092"
    assert cfg.services.redis_url == "redis://other:1/0"
    assert cfg.services.s3_secret_key == "s3cr3t-value"
    assert "s3cr3t-value" not in dump_config(cfg)


def test_loss_types_match_the_loss_library():
    from typing import get_args

    from pipeline.learning.losses import LOSS_TYPES

    assert set(get_args(LossType)) == set(LOSS_TYPES)


def test_rollout_topic_defaults_to_run_name():
    cfg = load_config(None, ["run.name=abc"], env={})
    assert cfg.run.topic == "abc.rollouts"


def test_every_field_is_documented_where_it_is_declared():
    from pydantic import BaseModel

    def walk(model: type[BaseModel], prefix: str):
        for name, field in model.model_fields.items():
            yield f"{prefix}{name}", field
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from walk(field.annotation, f"{prefix}{name}.")

    undocumented = [path for path, field in walk(HeteroConfig, "") if not field.description]
    assert undocumented == []


def test_task_paths_beside_the_config_file_but_a_set_override_as_typed(tmp_path, monkeypatch):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.jsonl").write_text("{}\n")
    (tmp_path / "conf" / "score.py").write_text("def f(p, c, a):\n    return 1.0\n")
    (tmp_path / "conf" / "run.yaml").write_text(
        "task:\n  name: dataset\n  path: train.jsonl\n  verifier: score.py:f\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(tmp_path / "conf" / "run.yaml")
    assert cfg.task.path == str((tmp_path / "conf" / "train.jsonl").resolve())
    assert cfg.task.verifier == f"{(tmp_path / 'conf' / 'score.py').resolve()}:f"
    typed = load_config(tmp_path / "conf" / "run.yaml", ["task.path=train.jsonl"])
    assert typed.task.path == "train.jsonl"  # from the working directory, as a shell user means it


def test_precision_auto_is_decided_by_the_machine(monkeypatch):
    """`precision: auto` is bf16 on a CPU with bf16 matrix units and fp32 on one without (where
    bf16 is emulated), whatever the config; each role logs the choice and why."""
    import torch

    from pipeline import devices as engine
    from pipeline.runtime import with_machine_precision

    cfg = load_config(None, ["learner.precision=auto", "sampler.precision=auto", "learner.zero_stage=0"], env={})
    cpu = torch.device("cpu")
    monkeypatch.setattr(engine, "cpu_flags", lambda: {"avx2", "fma"})
    chosen, line = with_machine_precision(cfg, cpu)
    assert (chosen.learner.precision, chosen.sampler.precision, chosen.learner.zero_stage) == ("fp32", "fp32", 0)
    assert "no bf16 matrix units" in line and line.startswith("precision: learner fp32, sampling fp32")
    monkeypatch.setattr(engine, "cpu_flags", lambda: {"avx2", "avx512f", "amx_bf16", "amx_tile"})
    chosen, line = with_machine_precision(cfg, cpu)
    # bf16 keeps its fp32 master weights in DeepSpeed's ZeRO optimizer: stage 1 at least.
    assert (chosen.learner.precision, chosen.sampler.precision, chosen.learner.zero_stage) == ("bf16", "bf16", 1)
    assert "(AMX)" in line and "eager attention gives the learner's and a PyTorch sampler's log-probs the same bits" in line
    # What learns, not only what is fast: with sdpa attention bf16's two sides disagree, so auto keeps fp32.
    sdpa = cfg.model_copy(update={"model": cfg.model.model_copy(update={"attention": "sdpa"})})
    chosen, line = with_machine_precision(sdpa, cpu)
    assert (chosen.learner.precision, chosen.sampler.precision) == ("fp32", "fp32")
    assert "model.attention=sdpa gives the sampler's and the learner's bf16 log-probs different bits" in line
    explicit = load_config(None, ["learner.precision=fp32", "sampler.precision=bf16"], env={})
    chosen, line = with_machine_precision(explicit, cpu)
    assert (chosen.learner.precision, chosen.sampler.precision) == ("fp32", "bf16") and "(" not in line
    with pytest.raises(ValueError, match="needs learner.zero_stage >= 1"):
        load_config(None, ["learner.precision=bf16", "learner.zero_stage=0"], env={})


def test_waiting_for_every_version_needs_every_version_published():
    with pytest.raises(ConfigError, match=r"sampler\.wait_for_next_version.*learner\.sync_every=2"):
        load_config(None, ["sampler.wait_for_next_version=true", "learner.sync_every=2"], env={})
    assert load_config(None, ["sampler.wait_for_next_version=true"], env={}).sampler.wait_for_next_version


def test_waiting_for_each_version_and_a_simulated_refresh_delay_exclude_each_other():
    with pytest.raises(ConfigError, match=r"sampler\.delays\.refresh \(fixed\) delays loading it"):
        load_config(None, ["sampler.wait_for_next_version=true", "sampler.delays.refresh.kind=fixed",
                           "sampler.delays.refresh.value=2"], env={})
