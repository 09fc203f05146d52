"""What travels to a GPU machine without a package registry (bench/gpu_pack.py) is derived from
the project's own requirements, and every module the product imports resolves there: from the
GPU image's packages, from the pack, or from an optional extra the user installs themselves."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_pack  # noqa: E402

# The lab travels too: bench/gpu_study.sh runs its study on the GPU machine.
SHIPPED = ("pipeline", "producers", "consumers", "infra", "heterorl", "lab")


def imported_top_level_modules() -> dict[str, set[str]]:
    """Every absolute import anywhere in the shipped code (inside functions too) -> the files."""
    found: dict[str, set[str]] = {}
    for package in SHIPPED:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for name in names:
                    found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def optional_extras() -> set[str]:
    """Distributions named only by the project's optional extras (besides `smollm2`, which is packed)."""
    from packaging.requirements import Requirement

    names = set()
    for line in metadata.distribution("heterorl").requires or []:
        req = Requirement(line)
        if req.marker is not None and "extra" in str(req.marker) and 'extra == "smollm2"' not in str(req.marker):
            names.add(gpu_pack.normalize(req.name))
    return names


def test_the_pack_is_the_runtime_closure_less_the_image():
    closure, image = gpu_pack.runtime_closure(), gpu_pack.image_packages()
    with_torch = set(gpu_pack.runtime_closure("torch", ())) | {"torch"}
    pack = gpu_pack.to_pack(image)
    assert set(pack) == set(closure) - image - with_torch
    # what the first GPU run found missing, by hand, is found here by derivation
    assert {"botocore", "cryptography", "zstandard", "tenacity", "kafka-python", "deepspeed", "gguf"} <= set(pack)
    assert "torch" in closure and "torch" not in pack  # the machine's own (CUDA) build is used
    assert all(pack[name] == metadata.version(name) for name in pack)  # the versions tested here
    # without a list of what the machine has, everything but torch and what torch needs
    assert set(gpu_pack.to_pack()) == set(closure) - with_torch and "transformers" in gpu_pack.to_pack()


def test_every_module_the_product_imports_resolves_on_the_gpu_image():
    """A static scan (imports inside functions count: the local S3 server's botocore is one),
    each top-level module mapped to the distribution that provides it here."""
    providers = metadata.packages_distributions()
    available = gpu_pack.image_packages() | set(gpu_pack.to_pack(gpu_pack.image_packages()))
    optional = optional_extras()
    unresolved = {}
    for module, files in imported_top_level_modules().items():
        if module in SHIPPED or module in sys.stdlib_module_names:
            continue
        dists = {gpu_pack.normalize(d) for d in providers.get(module, [])}
        if not dists & (available | optional):
            unresolved[module] = (sorted(dists), sorted(files)[:3])
    assert unresolved == {}, f"imported but neither in the GPU image, the pack nor an optional extra: {unresolved}"


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_study.sh"])
def test_the_gpu_scripts_pack_with_the_derived_list(script):
    text = (ROOT / "bench" / script).read_text()
    assert "gpu_pack.py" in text and "prepare-wheels" not in text and "../shared" not in text
