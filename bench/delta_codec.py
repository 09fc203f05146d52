"""Encoding and rebuilding one fp32 policy delta of SmolLM2-135M's shapes, with 1 thread and with
`codec_workers()` threads, side by side in one run (docs/weights.md).

    python bench/delta_codec.py [--workers N]

Synthetic weights (SmolLM2-135M's tensor shapes, 148M parameters) and an Adam-sized step that
moves every element, as an fp32 learner step does. Prints seconds per encode and rebuild for
each thread count, their ratio, and the delta's size; every rebuild is checked bit for bit."""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from pipeline.weights.codec import apply_delta, bits, codec_workers, encode_delta  # noqa: E402


def smollm2_shaped_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Synthetic fp32 weights of SmolLM2-135M's tensor shapes (148M parameters)."""
    shapes = [(49152, 576)] + [(576, 576)] * 4 * 30 + [(1536, 576)] * 3 * 30  # embeddings, attention, MLP
    return {f"t{i:03d}": 0.02 * torch.randn(s, generator=gen) for i, s in enumerate(shapes)}


def adam_sized_step(weights: dict[str, torch.Tensor], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The weights after a step that moves every element, as an fp32 learner step does."""
    return {k: v + 1e-6 * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=codec_workers(), help="threads of the second run "
                        "(default: codec_workers(), this process's cores, at most 8)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    base = smollm2_shaped_weights(gen)
    new = adam_sized_step(base, gen)
    print(f"{sum(t.numel() for t in base.values()) / 1e6:.1f}M fp32 parameters; {os.cpu_count()} cores")
    times = {}
    for workers in sorted({1, args.workers}):
        t0 = time.perf_counter()
        delta = encode_delta(base, new, workers=workers)
        t1 = time.perf_counter()
        rebuilt = apply_delta(base, delta, workers=workers)
        t2 = time.perf_counter()
        assert all((bits(rebuilt[k]) == bits(new[k])).all() for k in new)
        size = sum(len(b) for b in delta.payload.values()) / 1e6
        times[workers] = (t1 - t0, t2 - t1)
        print(f"workers {workers}: encode {t1 - t0:.2f} s, rebuild {t2 - t1:.2f} s, delta {size:.1f} MB")
    if len(times) == 2:
        (e1, r1), (en, rn) = times[1], times[args.workers]
        print(f"speed-up with {args.workers} threads: encode {e1 / en:.2f}x, rebuild {r1 / rn:.2f}x")


if __name__ == "__main__":
    main()
