"""The run configs that ship inside the package, found by name from any directory.

`heterorl train --config demo` reads `heterorl/configs/demo.yaml`; a path to a YAML file
still works and wins when both exist.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pipeline.config import ConfigError

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def builtin_configs() -> list[str]:
    """Names of the shipped configs (`demo`, `smoke`, `study`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def builtin_config(name: str) -> Path:
    """The path of a shipped config."""
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"no built-in config {name!r} (built-in configs: {', '.join(builtin_configs())})")
    return path


def config_path(name_or_path: Optional[str]) -> Optional[Path]:
    """A YAML file as given, or the name of a shipped config (`demo`, `demo.yaml`); None stays None."""
    if name_or_path is None:
        return None
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = name_or_path.removesuffix(".yaml")
    if "/" not in name and (CONFIG_DIR / f"{name}.yaml").is_file():
        return CONFIG_DIR / f"{name}.yaml"
    raise ConfigError(f"config file not found: {name_or_path} (built-in configs: {', '.join(builtin_configs())})")
