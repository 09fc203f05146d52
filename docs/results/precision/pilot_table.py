"""The table of README.md's section 3, from the four pilot cells' metrics.jsonl:

    python docs/results/precision/pilot_table.py > docs/results/precision/pilot_table.txt

Per cell: the median over steps 1-50 of the on-policy learner-sampler KL per token
(`mismatch_kl_median`; the older cells, which predate it and whose groups were all on-policy,
their `kl`), the training reward and the learner's mean log-prob of the sampled completions
(`learner_seq_logp_mean`) as means of steps 1-10 and 41-50, and the held-out accuracy at v0 and
v50 where it was evaluated."""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
CELLS = {
    "fp32, sdpa (Intel Xeon VM with AMX)": HERE.parent / "smollm2_plateau/pilot/gepo-d0-lr2e-6-fp32",
    "bf16, sdpa, nearest (Intel Xeon VM with AMX)": HERE.parent / "smollm2_plateau/pilot/gepo-d0-lr2e-6-bf16",
    "bf16, eager, nearest (AMD EPYC VM)": HERE / "bf16_eager_nearest",
    "bf16, eager, dithered (AMD EPYC VM)": HERE / "bf16_eager_dithered",
}


def main() -> None:
    print("| learner and sampler | on-policy KL, median per token | training reward, 1-10 -> 41-50 "
          "| learner's log-prob, 1-10 -> 41-50 | held-out at v0 -> v50 |")
    print("|---|---|---|---|---|")
    for name, cell in CELLS.items():
        rows = [json.loads(line) for line in (cell / "metrics.jsonl").read_text().splitlines() if line.strip()]
        step = {r["step"]: r for r in rows if r.get("kind") == "learner"}
        held = {r["policy_version"]: r["accuracy_sampled"] for r in rows if r.get("kind") == "eval"}

        def mean(first: int, last: int, key: str) -> float:
            return statistics.mean(step[s][key] for s in range(first, last + 1))

        kl = statistics.median(step[s].get("mismatch_kl_median", step[s]["kl"]) for s in range(1, 51))
        after = f"{held[50]:.3f}" if 50 in held else "not evaluated"
        print(f"| {name} | {kl:.2e} | {mean(1, 10, 'reward_mean'):.3f} -> {mean(41, 50, 'reward_mean'):.3f} "
              f"| {mean(1, 10, 'learner_seq_logp_mean'):.3f} -> {mean(41, 50, 'learner_seq_logp_mean'):.3f} "
              f"| {held[0]:.3f} -> {after} |")


if __name__ == "__main__":
    main()
