"""The memory a learner's kept deltas take: as the codec makes them, and packed into one buffer
each (`Delta.packed`, what `PolicyPublisher` keeps for its stale checks), side by side in one
run (docs/weights.md).

    python bench/delta_memory.py [--versions 36] [--keep 33]

Synthetic fp32 weights of SmolLM2-135M's tensor shapes (148M parameters) take `--versions`
steps of an Adam-sized update; each step's delta is encoded and the newest `--keep` are kept
(33: max delay 32, as `smollm2_study`). Each variant runs in its own process, so that one's
heap does not colour the other's. Prints, every fourth version, the bytes the kept parts hold
and the process's resident memory, then the ratio of the two variants' final resident memory."""

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/delta_codec.py's weights


def run_variant(packed: bool, versions: int, keep: int) -> list[dict]:
    """In this process: encode `versions` deltas, keep the newest `keep`; one row every fourth."""
    from collections import deque

    import torch

    from delta_codec import adam_sized_step, smollm2_shaped_weights
    from pipeline.weights.codec import encode_delta

    def rss_gib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30

    gen = torch.Generator().manual_seed(0)
    weights = smollm2_shaped_weights(gen)
    kept: deque = deque(maxlen=keep)
    rows = []
    for v in range(1, versions + 1):
        new = adam_sized_step(weights, gen)
        delta = encode_delta(weights, new)
        kept.append(delta.packed() if packed else delta)
        del delta
        weights = new
        if v % 4 == 0 or v == versions:
            held = sum(d.nbytes for d in kept) / 2**30
            rows.append({"version": v, "kept": len(kept), "held_gib": round(held, 2), "rss_gib": round(rss_gib(), 2)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", type=int, default=36, help="deltas encoded (default 36)")
    parser.add_argument("--keep", type=int, default=33, help="newest deltas kept (default 33: max delay 32)")
    parser.add_argument("--variant", choices=["as_made", "packed"], help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant == "packed", args.versions, args.keep)))
        return
    final = {}
    for variant in ("as_made", "packed"):
        print(f"{variant}:")
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--versions", str(args.versions),
                               "--keep", str(args.keep)], capture_output=True, text=True, check=True)
        rows = json.loads(proc.stdout)
        for r in rows:
            print(f"  v{r['version']:3d}: {r['kept']:2d} kept, parts {r['held_gib']:5.2f} GiB, resident {r['rss_gib']:5.2f} GiB")
        final[variant] = rows[-1]
    a, p = final["as_made"], final["packed"]
    print(f"resident memory with {a['kept']} deltas kept ({a['held_gib']:.2f} GiB of parts): "
          f"as made {a['rss_gib']:.2f} GiB, packed {p['rss_gib']:.2f} GiB, ratio {a['rss_gib'] / p['rss_gib']:.2f}x")


if __name__ == "__main__":
    main()
