"""The model cache: directories built once, published by an atomic rename, then reused.

Every model the product makes for itself (the warmed-up tiny model, a GGUF file converted
to safetensors, a Hub model saved locally) lives in `<services.data_dir>/models/<name>`.
A directory is built in a temporary sibling and renamed into place with its info file
written last, so a reader never sees a partial model, and two processes building the same
one at once are safe: the loser discards its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

INFO_FILE = "heterorl_base.json"
"""Written last into a finished cache directory: how it was made (and that it is complete)."""


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 of a file's bytes, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def is_complete(path: Path) -> bool:
    """Whether `path` is a finished cache directory."""
    return (path / INFO_FILE).is_file()


def build_once(final: Path, build: Callable[[Path], dict[str, Any]]) -> Path:
    """`final`, made by `build(tmp_dir)` on first use; `build` returns the info recorded in
    INFO_FILE (with the seconds it took). A later call returns the existing path at once."""
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        started = time.perf_counter()
        info = build(tmp)
        info = {**info, "build_seconds": round(time.perf_counter() - started, 3), "created_unix": time.time()}
        (tmp / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the target exists and is not empty).
            if not is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
