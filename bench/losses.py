"""Time forward+backward of every policy loss against the cheapest possible "loss".

Run:  python bench/losses.py [--batch 256] [--seq-len 2048] [--repeats 30] [--dtype float32]

The floor is `(learner_logps * mask).sum().backward()` on the same tensors: one read of
the log-probs forward, one gradient write backward. Each round visits every loss in a
shuffled order and times the floor right before it, so each ratio compares two
measurements taken side by side; every timed call follows an untimed warm-up call of
the same case (its own warm cache and allocator state, not what the previous case left).
The table reports medians over rounds: times, and the per-pair ratio loss/floor. The
issue's budget: GEPO within 3x of the floor (exit status 1 if it is not).

Memory: the script restarts itself with glibc's MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_ raised, so freed tensors stay in the heap instead of being
page-faulted in afresh on every call (that cost varied between runs by more than the
floor itself); gradients accumulate into one kept, zeroed buffer, as in training.

Timings include everything compute_policy_loss does: input validation, the loss, the
k3 KL (a metric even with kl_coef=0) and the metrics dict. With --threads 1 (default)
the clock is the thread's CPU time, so time the scheduler gives to other processes on
a shared machine is not counted; with more threads it is wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pipeline.learning.losses import LOSS_TYPES, compute_policy_loss, group_advantages  # noqa: E402

GEPO_BUDGET = 3.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256, help="sequences per batch B (default 256)")
    p.add_argument("--seq-len", type=int, default=2048, help="token slots per sequence T (default 2048)")
    p.add_argument("--group-size", type=int, default=8, help="sequences per prompt group (default 8)")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds first (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="log-prob dtype (default float32)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: stable timings on a shared machine)")
    p.add_argument("--losses", default=",".join(LOSS_TYPES),
                   help="comma-separated loss types to time (default: all); the floor and gepo always run")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_inputs(batch: int, seq_len: int, group_size: int, dtype: torch.dtype, seed: int) -> dict:
    """A batch that looks like real rollouts: ragged completions, shuffled groups, p close to q."""
    if batch % group_size:
        raise SystemExit(f"--batch ({batch}) must be a multiple of --group-size ({group_size})")
    gen = torch.Generator().manual_seed(seed)
    sampler = -torch.empty(batch, seq_len).exponential_(1.0, generator=gen)  # per-token log-probs <= 0
    learner = (sampler + 0.05 * torch.randn(batch, seq_len, generator=gen)).clamp(max=0.0)
    lengths = torch.randint(seq_len // 4, seq_len + 1, (batch,), generator=gen)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).to(dtype)
    group_ids = torch.arange(batch // group_size).repeat_interleave(group_size) * 7 + 3
    group_ids = group_ids[torch.randperm(batch, generator=gen)]
    rewards = torch.randint(0, 2, (batch,), generator=gen).float()
    return {
        "learner": (learner * mask).to(dtype).requires_grad_(),
        "sampler": (sampler * mask).to(dtype),
        "mask": mask,
        "group_ids": group_ids,
        "rewards": rewards,
        "advantages": group_advantages(rewards, group_ids),
    }


def cases(x: dict, seq_len: int, names: list[str]) -> dict:
    """name -> a closure doing one forward+backward."""
    lp = x["learner"]

    def floor() -> None:
        (lp * x["mask"]).sum().backward()

    def loss_case(loss_type: str, kl_coef: float = 0.0):
        def run() -> None:
            loss, _ = compute_policy_loss(loss_type, lp, x["sampler"], x["mask"], x["advantages"], x["group_ids"],
                                          max_completion_length=seq_len, rewards=x["rewards"], kl_coef=kl_coef)
            loss.backward()
        return run

    out = {"floor": floor, "gepo": loss_case("gepo")}
    out.update({name: loss_case(name) for name in names if name != "gepo"})
    out["gepo kl_coef=0.005"] = loss_case("gepo", 0.005)
    return out


STABLE_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def main(argv: list[str] | None = None) -> int:
    if argv is None and any(os.environ.get(k) != v for k, v in STABLE_MALLOC.items()):
        # glibc otherwise hands large tensors back to the OS and page-faults them in again,
        # at a cost that varies from run to run by more than the floor itself; keeping
        # freed memory in the heap makes both sides of each ratio steady. Restart with it.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **STABLE_MALLOC})
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    x = make_inputs(args.batch, args.seq_len, args.group_size, DTYPES[args.dtype], args.seed)
    names = [n.strip() for n in args.losses.split(",") if n.strip()]
    unknown = sorted(set(names) - set(LOSS_TYPES))
    if unknown:
        raise SystemExit(f"--losses: unknown {unknown}; valid: {', '.join(LOSS_TYPES)}")
    todo = cases(x, args.seq_len, names)
    floor = todo.pop("floor")
    times: dict[str, list[float]] = {name: [] for name in ["floor", *todo]}
    ratios: dict[str, list[float]] = {name: [] for name in todo}
    order = list(todo)
    rng = random.Random(args.seed)
    clock = time.thread_time if args.threads == 1 else time.perf_counter

    def timed(fn) -> float:
        # Gradients accumulate into one kept buffer (zeroed, not freed), as in a training
        # loop: otherwise each backward allocates fresh pages and the page faults, which
        # vary from process to process, swamp the floor being compared against.
        fn()  # untimed warm-up call: each case starts from its own warm state
        x["learner"].grad.zero_()
        start = clock()
        fn()
        return (clock() - start) * 1e3

    for round_ in range(args.warmup + args.repeats):
        rng.shuffle(order)
        for name in order:  # each loss is timed right after a fresh floor measurement
            floor_ms, loss_ms = timed(floor), timed(todo[name])
            if round_ >= args.warmup:
                times["floor"].append(floor_ms)
                times[name].append(loss_ms)
                ratios[name].append(loss_ms / floor_ms)

    print(f"B={args.batch} T={args.seq_len} group_size={args.group_size} dtype={args.dtype} "
          f"threads={args.threads} ({'thread CPU time' if args.threads == 1 else 'wall time'}) "
          f"repeats={args.repeats} torch={torch.__version__}")
    print(f"{'case':<20}{'median ms':>11}{'ratio to floor':>16}")
    print(f"{'floor':<20}{statistics.median(times['floor']):>11.2f}{1.0:>15.2f}x")
    for name in todo:
        print(f"{name:<20}{statistics.median(times[name]):>11.2f}{statistics.median(ratios[name]):>15.2f}x")
    gepo_ratio = statistics.median(ratios["gepo"])
    verdict = "OK" if gepo_ratio <= GEPO_BUDGET else "OVER BUDGET"
    print(f"gepo / floor = {gepo_ratio:.2f}x (budget {GEPO_BUDGET:.0f}x): {verdict}")
    return 0 if gepo_ratio <= GEPO_BUDGET else 1


if __name__ == "__main__":
    sys.exit(main())
