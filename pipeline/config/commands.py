"""The sections of the commands, not of a run's roles: what `heterorl train` starts (`train`) and logs
to Weights & Biases (`wandb`), the grid of `heterorl study delay` (`study`) and the capacity rig
`heterorl loadtest` (`loadtest`). They sit in the run's one YAML file beside the roles' sections,
which is how a study or rig config stays one file validated as a whole; the roles never read them.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import LossType, Strict


class StudyConfig(Strict):
    """The grid of `heterorl study delay` (its --losses, --max-delays and --seeds win), so a
    study's design is fixed in its config file before it runs."""

    losses: list[LossType] = Field(default_factory=lambda: ["gepo", "gspo", "grpo"], min_length=1)
    """Loss of each row."""
    max_delays: list[int] = Field(default_factory=lambda: [0, 4, 16, 64], min_length=1)
    """`learner.max_delay_steps` of each column."""
    seeds: list[int] = Field(default_factory=lambda: [1], min_length=1)
    """`run.seed` and `sampler.delays.seed` of each repetition."""
    evaluations_averaged: int = Field(1, ge=1)
    """Best and Last are each the mean of this many consecutive evaluations: Best the highest
    such mean, Last the mean of the final ones (1: single evaluations)."""

    @field_validator("max_delays")
    @classmethod
    def _non_negative_delays(cls, v: list[int]) -> list[int]:
        if any(d < 0 for d in v):
            raise ValueError("max delays are >= 0 learner steps")
        return sorted(set(v))


class GpuClassConfig(Strict):
    """One kind of sampler hardware in a `heterorl loadtest` fleet, and the WAN link its samplers sit behind."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
    """Label in the report (e.g. h100)."""
    share: float = Field(gt=0)
    """Its part of the fleet (shares are normalised over the fleet's classes)."""
    tokens_per_s: float = Field(gt=0)
    """Completion tokens one sampler of this class generates per second, all sequences of a batch
    together (a batched vLLM engine's throughput on the model being trained)."""
    weight_load_s: float = Field(1.0, ge=0)
    """Seconds its engine needs to take verified new weights in (a vLLM reload), during which it
    does not generate."""
    latency_ms: float = Field(40.0, ge=0)
    """One-way latency of its link to Redis and S3 (infra.fault_proxy), and of its groups' transit."""
    jitter_ms: float = Field(10.0, ge=0)
    """Extra one-way latency drawn uniformly from [0, jitter_ms] per chunk."""
    bandwidth_mbit_s: Optional[float] = Field(100.0, gt=0)
    """Its link's bandwidth per connection and direction (None: unlimited)."""
    resets_per_hour: float = Field(0.0, ge=0)
    """Connections of its link reset this often (a flaky WAN)."""


def _default_fleets() -> dict[str, list[GpuClassConfig]]:
    classes = {"h100": (5000.0, 40.0), "a100": (3000.0, 60.0), "l4": (1000.0, 90.0)}
    hetero = [GpuClassConfig(name=n, share=1.0, tokens_per_s=t, latency_ms=lat) for n, (t, lat) in classes.items()]
    return {"uniform": [GpuClassConfig(name="a100", share=1.0, tokens_per_s=3000.0, latency_ms=60.0)],
            "heterogeneous": hetero}


class LoadtestConfig(Strict):
    """`heterorl loadtest`: simulated samplers whose generation is modeled by their hardware's
    speed, everything else the product's code (docs/loadtest.md). The learner, sampler and
    security sections of the config apply to the rig's learner and samplers as to a run."""

    samplers: list[int] = Field(default_factory=lambda: [1, 4, 16, 64, 256], min_length=1)
    """Fleet sizes, one report row each (--samplers wins)."""
    fleets: dict[str, list[GpuClassConfig]] = Field(default_factory=_default_fleets)
    """Named fleet profiles: the classes each fleet is made of."""
    fleet: str = "heterogeneous"
    """The profile of the scaling rows."""
    compare_fleets: list[str] = Field(default_factory=lambda: ["uniform", "heterogeneous"])
    """Profiles on which async is measured against the lock-step baseline."""
    compare_samplers: int = Field(16, ge=1)
    """Fleet size of the async-against-sync comparison."""
    warmup_steps: int = Field(10, ge=1)
    """Learner steps (waited for at most 90 s after the first) before the warm-up seconds start:
    a fleet that starts together first sends a burst that takes the learner a few steps to clear."""
    warmup_s: float = Field(20.0, ge=0)
    """Seconds after `warmup_steps` steps before measuring."""
    measure_s: float = Field(60.0, gt=0)
    """Seconds measured per row."""
    broker_storage: Literal["memory", "s3"] = "memory"
    """Where the rig's local broker (Tansu) keeps the log: `memory`, or `s3` as `heterorl up` does
    (there its log goes through the same single-threaded local S3 server as the weights, which
    saturated first at 256 samplers: docs/loadtest.md)."""
    samplers_per_process: int = Field(32, ge=1)
    """Simulated samplers sharing one process (each keeps its own clients, key, spool and link)."""
    prompt_tokens: int = Field(256, ge=1)
    """Prompt length of the modeled groups."""
    completion_tokens_median: float = Field(300.0, gt=0)
    """Median completion length; lengths are log-normal, cut at `sampler.max_new_tokens`."""
    completion_tokens_sigma: float = Field(0.8, ge=0)
    """Log-normal sigma of completion lengths (0: every completion the median)."""
    vocab_size: int = Field(49152, ge=2)
    """Token ids of the modeled messages are drawn below this (SmolLM2's vocabulary)."""
    reward_p: float = Field(0.5, ge=0, le=1)
    """Chance a modeled completion is rewarded 1 (else 0)."""
    learner_step_s: float = Field(4.0, gt=0)
    """Modeled time of one optimizer step on `learner.groups_per_step` groups."""
    reward_check_s_per_group: float = Field(0.02, ge=0)
    """Modeled cost of the learner re-scoring one group's rewards (`security.rescore_rewards`)."""
    logprob_check_s_per_group: float = Field(0.04, ge=0)
    """Modeled cost of the learner re-scoring one stale group's log-probs (`security.check_logprobs`:
    every one of a key on probation, a share of the rest); a fresh group's check rides on the
    step's forward passes and costs nothing of its own."""
    weight_change_share: float = Field(0.01, ge=0, le=1)
    """Share of the weights each modeled step changes (the delta a real step makes, docs/weights.md)."""

    @model_validator(mode="after")
    def _fleets_named(self) -> "LoadtestConfig":
        for name in [self.fleet, *self.compare_fleets]:
            if name not in self.fleets:
                raise ValueError(f"loadtest fleet {name!r} is not in loadtest.fleets ({', '.join(self.fleets)})")
        for name, classes in self.fleets.items():
            if not classes:
                raise ValueError(f"loadtest.fleets.{name} has no classes")
        return self

    @field_validator("samplers")
    @classmethod
    def _positive_counts(cls, v: list[int]) -> list[int]:
        if any(n < 1 for n in v):
            raise ValueError("sampler counts are >= 1")
        return v


class TrainConfig(Strict):
    num_samplers: int = Field(2, ge=1)
    """Sampler processes started by `heterorl train`."""
    num_validators: int = Field(0, ge=0)
    """Validator processes started by `heterorl train` (docs/security.md "Validators"); with any,
    `validators.enabled` is on: the learner uses only groups they passed."""
    out_dir: Optional[str] = None
    """Run directory (metrics.jsonl, TensorBoard events, summary.json, plots); default runs/<run name>."""
    timeout_s: float = Field(1800.0, gt=0)
    """Abort the run (stopping every process it started) after this long."""
    fast_start: bool = True
    """Start the learner and samplers before the base model's held-out evaluation, which then
    runs beside their start-up (on a shared CPU at nice 19, so it takes only cores they leave
    idle), and have the samplers load v0 from the base model's files, checked against its
    digest, instead of waiting for the learner's first keyframe through S3
    (`sampler.local_v0_sha256`). False: evaluate first, then start the roles, v0 through S3."""
    weights_by_shared_memory: bool = True
    """The learner's publisher also writes each version whole into a directory in /dev/shm, and
    the samplers `train` starts (on the same host) take it from there, checked against its
    signed manifest, instead of downloading it from S3 and rebuilding it from deltas
    (`learner.host_copies_dir`, `sampler.host_copies_dir`). Where /dev/shm is not there, or
    fills up, versions go through S3 as for any sampler."""
    cpu_sharing: Literal["yield", "priority", "split", "none"] = "yield"
    """How the processes `train` starts on its one machine share the cores (docs/performance.md
    has the measurements behind the default):
    `yield`: each may use every core; the samplers pause while the learner admits, checks and
    trains a batch (`sampler.yield_to_learner`), and the evaluator downloads the versions due
    as they come but scores them after training (`eval.after_training`), at idle priority
    (Linux SCHED_IDLE);
    `priority`: each may use every core, and the scheduler serves the learner first, then the
    samplers (nice 10), then the evaluator (nice 19);
    `split`: the cores divided, each sampler `sampler.torch_threads` of them, the evaluator
    `eval.torch_threads` (at nice 19), the learner the rest;
    `none`: the configured `torch_threads` of each role, at equal priority.
    With the model on a GPU (`model.device`) the roles compute there: `none` whatever is set."""


class WandbConfig(Strict):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (off by default; needs the `wandb`
    package: `pip install wandb`). `heterorl train` logs the learner's and the evaluations'
    records as they are written, the run's config (no secrets), the summary and report.png."""

    enabled: bool = False
    """Log this run to W&B."""
    project: str = "heterorl"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (user or team); default: the logged-in user's."""
    mode: Literal["online", "offline"] = "online"
    """`offline` writes the run under RUN_DIR/wandb/ for a later `wandb sync` (no network, no login)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""
