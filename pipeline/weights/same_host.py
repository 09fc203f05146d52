"""What a sampler on the learner's host takes from it directly, instead of through S3.

Samplers elsewhere download each version from S3 (`pipeline.weights.policy.fetch_policy`);
`heterorl train` starts its samplers on the learner's own host, where two things are at hand.

**v0 from the base model's files.** A run's v0 is its base model: the learner loads
`model.base` and publishes its weights, in `learner.policy_dtype`, as the run's first keyframe.
A sampler on its host has the same files on disk, so it needs neither the learner's start-up
nor the trip through S3 to begin (`train.fast_start`). What it loads must still be the run's v0:

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

**Each later version through shared memory.** The learner's publisher process also writes each
version it publishes, whole, into a directory in shared memory (`HostCopies`:
`learner.host_copies_dir`, `/dev/shm/...` under `train.weights_by_shared_memory`), before the
pointer names it; a sampler with the same directory (`sampler.host_copies_dir`) reads it there
and checks it as it checks a download (`pipeline.weights.policy.check_copy`: every tensor
against the signed manifest's sha256, every other file), so no download and no delta rebuild
run in its process. A copy that is missing, pruned meanwhile or does not match is downloaded
instead. CUDA IPC (a GPU's memory shared between processes) is not built: on a GPU the copy is
in host memory, and the sampler moves it to the GPU as it moves a downloaded one.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from pathlib import Path
from typing import Optional

import torch

from pipeline.weights.policy import lay_out, other_files, read_weights, weights_files, write_model_dir
from pipeline.weights.store import CorruptCheckpointError, sha256_file

log = logging.getLogger(__name__)


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


class HostCopies:
    """The publisher's side of the shared-memory path: each version whole in `directory/v<N>/`
    (written next to it, then renamed: it appears complete or not at all), the newest `keep`
    kept (a sampler may still be reading the one before). A copy that cannot be written (a full
    /dev/shm: a container's is 64 MB by default) is said once, and no more are written: samplers
    download every version, as samplers elsewhere do."""

    KEEP = 2

    def __init__(self, directory: Path, template: Path, keep: int = KEEP):
        self.directory, self.template, self.keep = Path(directory), Path(template), keep
        self.others = other_files(self.template)
        self.failed: Optional[str] = None
        self.written: list[int] = []

    def put(self, version: int, tensors: dict[str, torch.Tensor]) -> Optional[Path]:
        """`tensors` (the state dict published as `version`) written as `v<version>/`; None if not."""
        if self.failed is not None:
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = write_model_dir(lay_out(tensors, self.template), self.others, self.template,
                                   self.directory / f"v{version}")
        except OSError as e:
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("could not write v%d to %s (%s): samplers on this host download every version from now on",
                        version, self.directory, self.failed)
            return None
        self.written.append(version)
        for old in self.written[:-self.keep]:
            self.remove(old)
        self.written = self.written[-self.keep:]
        return path

    def close(self) -> None:
        """Remove the copies written, and the directory once empty: a learner that ends takes its
        copies with it (`heterorl train` removes the directory too)."""
        for version in self.written:
            self.remove(version)
        self.written = []
        try:
            self.directory.rmdir()
        except OSError:  # not empty (not ours alone), or never made
            pass

    def remove(self, version: int) -> None:
        """`v<version>/` and whatever a reader made beside it (`v<version>.engine/`: docs/weights.md)."""
        for entry in self.directory.glob(f"v{version}*"):
            if entry.name == f"v{version}" or entry.name.startswith(f"v{version}."):
                shutil.rmtree(entry, ignore_errors=True)
