"""The GPU check's first step: is this Python ready to run the product on a GPU?

    python bench/gpu_preflight.py [--need-gpu] [--config smollm2]

Prints the interpreter, torch (its version, `torch.version.cuda`: the CUDA build or the CPU
build, and the GPU it sees), transformers, the precision `precision: auto` picks here for the
config, and SmolLM2-135M-Instruct's GGUF file; imports every module of the repository's packages
(pipeline, producers, consumers, infra, heterorl, lab) and of the GPU check's scripts. Exit
status 1 if a module does not import or the model file is missing, 3 with `--need-gpu` where
torch sees no CUDA GPU, else 0. `bench/gpu_check.sh` runs it first (`--dry-run`: it alone).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import platform
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "producers", "consumers", "infra", "heterorl", "lab")
SCRIPTS = ("async_vs_sync", "run_digest", "gpu_check_summary")


def import_everything() -> tuple[int, dict[str, str]]:
    """How many modules imported, and the error of each that did not."""
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    count, failed = 0, {}
    names = []
    for package in PACKAGES:
        try:
            module = importlib.import_module(package)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            failed[package] = f"{type(e).__name__}: {e}"
            continue
        names += [info.name for info in pkgutil.walk_packages(module.__path__, package + ".")
                  if not info.name.endswith("__main__")]  # __main__ would run the CLI
    for name in names + list(SCRIPTS):
        try:
            importlib.import_module(name)
            count += 1
        except Exception as e:  # noqa: BLE001
            failed[name] = f"{type(e).__name__}: {e}"
    return count, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--need-gpu", action="store_true", help="exit 3 unless torch sees a CUDA GPU")
    parser.add_argument("--config", default="smollm2", help="the config whose `precision: auto` to resolve")
    args = parser.parse_args()
    print(f"python {platform.python_version()} ({sys.executable}) on {platform.machine()}")
    try:
        import torch
    except ImportError as e:
        print(f"torch: not importable ({e}): install the machine's torch build first")
        return 1
    cuda = torch.version.cuda
    gpu = torch.cuda.is_available()
    print(f"torch {torch.__version__} ({f'torch.version.cuda {cuda}: the CUDA build' if cuda else 'the CPU build'}"
          f"{', ROCm ' + torch.version.hip if getattr(torch.version, 'hip', None) else ''}); GPU: "
          + (f"{torch.cuda.get_device_name(0)} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)"
             if gpu else "none visible to torch"))
    count, failed = import_everything()
    try:
        import transformers
        print(f"transformers {transformers.__version__}")
    except ImportError as e:
        failed.setdefault("transformers", str(e))
    print(f"modules: {count} imported from {', '.join(PACKAGES)} and bench/"
          + (f"; {len(failed)} failed:" if failed else ", none failed"))
    for name, error in sorted(failed.items()):
        print(f"  {name}: {error}")
    status = 1 if failed else 0
    if not failed:
        try:
            from heterorl.config_files import config_path
            from pipeline.config import load_config
            from pipeline.devices import resolve_device
            from pipeline.runtime import with_machine_precision

            cfg = load_config(str(config_path(args.config)), [])
            print(f"{args.config}: {with_machine_precision(cfg, resolve_device(cfg.model.device))[1]}")
        except Exception:  # noqa: BLE001
            print(f"{args.config}: precision not resolved:\n{traceback.format_exc(limit=3)}")
            status = 1
        try:
            from pipeline.models.sources import builtin_file

            print(f"model: {builtin_file('smollm2-135m-instruct')}")
        except Exception as e:  # noqa: BLE001
            print(f"model: {e}")
            status = 1
    if args.need_gpu and not gpu:
        print("no CUDA GPU visible to torch: " + (
            "this torch is the CPU build; on a machine where nvidia-smi lists a GPU, `rm -rf .venv && make install` "
            "installs the CUDA build (or `make install GPU=1`)" if not cuda else
            "the CUDA build sees no GPU (nvidia-smi, the driver, CUDA_VISIBLE_DEVICES)"))
        return 3
    return status


if __name__ == "__main__":
    sys.exit(main())
