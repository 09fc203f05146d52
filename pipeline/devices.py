"""Where a role computes and in what precision: `model.device` and `precision: auto` resolved
on the machine the role runs on, and the CPU's name for labelling timings. Every role (the
learner, samplers, validators, the evaluator) asks here; nothing here imports DeepSpeed."""

from __future__ import annotations

import platform
from contextlib import contextmanager
from pathlib import Path

import torch

from pipeline.config import ConfigError


def resolve_device(setting: str, local_rank: int = 0) -> torch.device:
    """`model.device` as a torch device: `auto` is this rank's GPU if there is one, else the CPU.

    Raises ConfigError if a GPU is asked for and none (or not that one) is visible.
    """
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"model.device={setting}, but no GPU is visible to this process (use cpu or auto)")
    device = torch.device(setting if setting not in ("auto", "cuda") else f"cuda:{local_rank}")
    if device.index >= torch.cuda.device_count():
        raise ConfigError(f"model.device={setting}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def machine_precision(device: torch.device) -> tuple[str, str]:
    """The fastest exact precision of `device` for `precision: auto`, and why: ("bf16" | "fp32", reason).

    bf16 where the machine multiplies it natively (a CUDA GPU that supports it; a CPU with AMX
    or AVX512-BF16 units), fp32 elsewhere: on a CPU with only AVX2 a bf16 matmul is emulated,
    and a 512 x 576 x 1536 one took 763 ms against 10 ms in fp32 (docs/models.md)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if torch.cuda.is_bf16_supported():
            return "bf16", f"GPU {name} multiplies bf16 natively"
        return "fp32", f"GPU {name} has no native bf16"
    flags = cpu_flags()
    units = [name for name, flag in (("AMX", "amx_bf16"), ("AVX512-BF16", "avx512_bf16")) if flag in flags]
    kind = cpu_kind()
    if units:
        return "bf16", f"CPU {kind} has bf16 matrix units ({', '.join(units)})"
    return "fp32", f"CPU {kind} has no bf16 matrix units (no AMX, no AVX512-BF16): bf16 would be emulated, far slower"


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo; empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_kind() -> str:
    """The CPU's model name and widest vector unit torch uses, e.g. "AMD EPYC (AVX2)": what a
    timing taken on it should be labelled with."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name} ({torch.backends.cpu.get_cpu_capability()})"


def resolve_precision(setting: str, device: torch.device) -> tuple[str, str]:
    """A configured precision as the one to use: `auto` is `machine_precision`; an explicit one
    is kept ("as configured")."""
    if setting == "auto":
        return machine_precision(device)
    return setting, "as configured"


OUT_OF_MEMORY = ("out of memory", "can't allocate memory", "not enough memory")
"""What torch's allocators say when they have no room: CUDA's OutOfMemoryError ("CUDA out of
memory"), the CPU's "DefaultCPUAllocator: can't allocate memory", pinned host memory's "out of
memory" from cudaHostAlloc."""


def out_of_memory(error: BaseException) -> str | None:
    """The first line of `error` if it is a device or host allocator out of memory (the
    machine's fault, not the data's: retried or placed elsewhere, never refused for), else None."""
    said = str(error).splitlines()[0][:160] if str(error) else ""
    if isinstance(error, torch.cuda.OutOfMemoryError) or (
            isinstance(error, RuntimeError) and any(words in said.lower() for words in OUT_OF_MEMORY)):
        return said or "out of memory"
    return None


@contextmanager
def one_cpu_thread(enabled: bool = True):
    """Run the torch operations inside on one intra-op thread (`torch.set_num_threads`, restored
    after). For memory-bound copies on a CPU whose cores another process is using (a learner's
    copies of its weights while its sampler generates on the same cores): each parallel copy
    waits at its OpenMP barrier for a thread the scheduler has parked behind the other process
    (docs/performance.md: 2.8 s for SmolLM2's first copies in a `heterorl train` run on two
    threads, 0.35 s on one). Where the cores are free one thread is a few milliseconds slower
    per copy (bench/copy_beside_work.py prints both). The setting is the process's: other
    threads' operations meanwhile run on one too."""
    if not enabled:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
