"""v0 from the base model's own files, for a sampler on the learner's host.

A run's v0 is its base model: the learner loads `model.base` and publishes its weights, in
`learner.policy_dtype`, as the run's first keyframe. A sampler elsewhere downloads that
keyframe; one on the learner's host has the same files on disk, so it needs neither the
learner's start-up nor the trip through S3 to begin (`heterorl train`'s fast start,
`train.fast_start`). What it loads must still be the run's v0, so:

- `heterorl train` hashes the base model's files once (`base_digest`) and names the digest in
  the samplers' config (`sampler.local_v0_sha256`);
- the sampler hashes the files it finds and refuses a base whose digest differs
  (`lay_out_local_v0` raises CorruptCheckpointError; the sampler then waits for v0 through S3,
  like any other);
- it lays v0 out as the learner publishes it (each weights file's tensors, floating-point ones
  in the policy dtype) in its work directory, where later versions' deltas are applied: their
  rebuilt tensors are checked against the learner's signed sha256, so a local v0 that was not
  the learner's bit for bit is refused at the first delta (`fetch_policy` then takes the
  keyframe path).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pipeline.weights.policy import other_files, read_weights, weights_files, write_model_dir
from pipeline.weights.store import CorruptCheckpointError, sha256_file


def policy_dtype(learner_cfg) -> torch.dtype:
    """The dtype of the weights samplers get (`learner.policy_dtype`; `auto`: the learner's
    precision, already resolved for this machine)."""
    from pipeline.models import DTYPES

    return DTYPES[learner_cfg.precision if learner_cfg.policy_dtype == "auto" else learner_cfg.policy_dtype]


def base_digest(model_dir: Path) -> str:
    """One sha256 over every file a policy version of `model_dir` holds: its weights files and
    its other files (config, tokenizer), each as (relative path, sha256), in path order."""
    model_dir = Path(model_dir)
    entries = [(name, sha256_file(model_dir / name)) for name in weights_files(model_dir)]
    entries += [(f["path"], f["sha256"]) for f in other_files(model_dir)]
    digest = hashlib.sha256()
    for path, sha in sorted(entries):
        digest.update(f"{path}\0{sha}\n".encode())
    return digest.hexdigest()


def lay_out_local_v0(model_dir: Path, dest_dir: Path, dtype: torch.dtype, expected_digest: str) -> Path:
    """`model_dir` written to `dest_dir` as the learner publishes v0: its other files as they
    are, its weights files' tensors with floating-point ones in `dtype`. CorruptCheckpointError
    where `model_dir`'s files do not hash to `expected_digest` (nothing is written then)."""
    model_dir, dest_dir = Path(model_dir), Path(dest_dir)
    found = base_digest(model_dir)
    if found != expected_digest:
        raise CorruptCheckpointError(
            f"refused the base model in {model_dir} as v0: its files hash to {found[:12]}…, not the "
            f"{expected_digest[:12]}… of the base the run started from (sampler.local_v0_sha256)")
    weights = {name: {key: t.to(dtype) if t.is_floating_point() else t for key, t in tensors.items()}
               for name, tensors in read_weights(model_dir).items()}
    dest_dir.parent.mkdir(parents=True, exist_ok=True)
    return write_model_dir(weights, other_files(model_dir), model_dir, dest_dir)
