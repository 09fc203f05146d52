"""The learner's copies of its weights on a CPU whose cores another process is using, on all the
intra-op threads against one, side by side in one run.

    python bench/copy_beside_work.py [--config smollm2] [--repeats 3] [--out DIR]

The learner copies its weights into the publisher's shared-memory slot after each published
step (`pipeline.weights.publisher.copy_weights_into`) and into host memory for each recovery
state (`pipeline.weights.learner_state.capture`). On a machine it shares with its samplers
(`heterorl train` on a CPU) a sampler may be generating meanwhile. A copy split over OpenMP
threads then waits at each tensor's barrier for a thread the scheduler has parked behind the
other process: the copies run on one thread (`pipeline.devices.one_cpu_thread`).

Loads the config's base model in bf16 (as the learner trains it where the CPU multiplies bf16
natively) and lays out two slots as the learner's publisher does. For each of: the cores free,
and a process doing matrix products on as many threads as there are cores beside it, it copies
the weights into each slot `--repeats` times (the first copy into a slot also maps its pages)
with the process's intra-op threads (`torch.get_num_threads()`) and with one, and prints the
seconds of each and their ratio. `--out DIR` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HOG = ("import torch, sys\ntorch.set_num_threads(int(sys.argv[1]))\na = torch.randn(1500, 1500)\n"
       "while True:\n    a @ a\n")
"""The other process: matrix products on N threads until killed (a sampler's decode is such work)."""


def copy_seconds(module, slots, repeats: int, one_thread: bool) -> dict:
    """Seconds of each copy into each slot: the first of each (pages mapped then), and the rest."""
    from pipeline.weights import publisher

    first, later = [], []
    for slot in range(len(slots.buffers)):
        for i in range(repeats):
            patched = contextlib.nullcontext() if one_thread else _threads_as_they_are(publisher)
            with patched:
                started = time.perf_counter()
                publisher.copy_weights_into(module, slots.views(slot))
                (first if i == 0 else later).append(time.perf_counter() - started)
    return {"first_s": round(statistics.mean(first), 3), "later_s": round(statistics.median(later), 3)}


@contextlib.contextmanager
def _threads_as_they_are(publisher):
    """`copy_weights_into` as it was: on every intra-op thread."""
    real = publisher.one_cpu_thread
    publisher.one_cpu_thread = lambda enabled=True: contextlib.nullcontext()
    try:
        yield
    finally:
        publisher.one_cpu_thread = real


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="a built-in config or a YAML file (its model.base)")
    parser.add_argument("--repeats", type=int, default=3, help="copies into each slot per setting (>= 2)")
    parser.add_argument("--out", type=Path, help="write DIR/copy_beside_work.json")
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be at least 2")

    import torch
    from transformers import AutoModelForCausalLM

    from heterorl.config_files import builtin_config
    from pipeline.config import load_config
    from pipeline.devices import cpu_kind
    from pipeline.runtime import resolve_base_model
    from pipeline.weights.publisher import SnapshotSlots, slot_layout

    source = args.config if args.config.endswith((".yaml", ".yml")) else builtin_config(args.config)
    model_dir = resolve_base_model(load_config(source))
    module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    places = slot_layout(model_dir, {k: tuple(t.shape) for k, t in module.state_dict().items()}, torch.bfloat16)
    threads, cores = torch.get_num_threads(), os.cpu_count() or 1
    print(f"{model_dir.name}: {sum(p.nbytes for p in places) / 1e6:.0f} MB a copy; {threads} intra-op threads, "
          f"{cores} cores; CPU: {cpu_kind()}")
    rows = {}
    for beside in ("cores free", f"a {cores}-thread process beside"):
        # in a session of its own, as `heterorl train` starts each role: with Linux autogroups on,
        # the scheduler then shares the cores between the two sessions, not between their threads
        hog = None if beside == "cores free" else subprocess.Popen([sys.executable, "-c", HOG, str(cores)],
                                                                   start_new_session=True)
        try:
            time.sleep(0 if hog is None else 3)  # the other process at work
            for one_thread in (False, True):
                slots = SnapshotSlots(places)
                try:
                    rows[(beside, one_thread)] = copy_seconds(module, slots, args.repeats, one_thread)
                finally:
                    slots.close()
        finally:
            if hog is not None:
                hog.kill()
                hog.wait()
    print(f"\n{'':28} {'first copy (s)':>22} {'later copies (s)':>22}")
    print(f"{'':28} {f'{threads} threads':>10} {'1 thread':>10}  {f'{threads} threads':>10} {'1 thread':>10}")
    result = {"model": model_dir.name, "threads": threads, "cores": cores, "cpu": cpu_kind(), "rows": []}
    for beside in dict.fromkeys(b for b, _ in rows):
        many, one = rows[(beside, False)], rows[(beside, True)]
        print(f"{beside:28} {many['first_s']:>10.3f} {one['first_s']:>10.3f}  {many['later_s']:>10.3f} "
              f"{one['later_s']:>10.3f}   ratio (threads / one) {many['first_s'] / max(one['first_s'], 1e-9):.1f}x, "
              f"{many['later_s'] / max(one['later_s'], 1e-9):.1f}x")
        result["rows"].append({"beside": beside, "all_threads": many, "one_thread": one})
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "copy_beside_work.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
