"""GEPO's importance weight on-policy on SmolLM2-135M-Instruct, at two sampling settings.

    python docs/results/smollm2/gepo_weights/gepo_weights.py [--prompts 64]

On-policy the learner's p is the sampler's q, so GEPO's weight of completion i of a group
is w_i = q̄_i / Ê_q[q] with Ê_q[q] = Σ_j q̄_j² / Σ_j q̄_j (GEPO, arXiv:2508.17850; docs/losses.md; q̄ the geometric
mean of the token probabilities): 1 only when the group's completions are equally likely.
With the clip at 1 ± 0.2, a completion with positive advantage and w > 1.2 gets no gradient,
and one with negative advantage and w < 0.8 none either. This samples groups of 8 from the
base model on the `smollm2` task's training prompts at each setting and writes the weight's
distribution to gepo_weights.json beside this file (and prints it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

SETTINGS = {"T 1.0 (the old smollm2 config)": dict(temperature=1.0, top_p=1.0, top_k=0),
            "T 0.6, top-p 0.95, top-k 20 (the seed system's)": dict(temperature=0.6, top_p=0.95, top_k=20)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64, help="prompt groups per setting")
    args = parser.parse_args()
    from heterorl.config_files import config_path
    from pipeline.config import load_config
    from pipeline.learning.losses import gepo_log_expectation, group_advantages
    from pipeline.models import load_policy, sample_groups
    from pipeline.runtime import make_task_from_config, resolve_base_model
    from producers.sampler import score_groups

    cfg = load_config(str(config_path("smollm2")), [])
    task = make_task_from_config(cfg)
    model, tokenizer = load_policy(resolve_base_model(cfg))
    problems = [task.train_problem(i) for i in range(args.prompts)]
    prompts = [task.encode_prompt(p, tokenizer) for p in problems]
    out = {"prompts": args.prompts, "group_size": 8, "max_new_tokens": cfg.sampler.max_new_tokens, "settings": {}}
    for name, sampling in SETTINGS.items():
        with torch.no_grad():
            sampled = sample_groups(model, tokenizer, prompts, group_size=8, max_new_tokens=cfg.sampler.max_new_tokens,
                                    seed=0, **sampling)
        groups = score_groups(task, tokenizer, problems, sampled, sampler_id="probe", policy_version=0,
                              sampling={"temperature": sampling["temperature"]})
        seq_logq = torch.tensor([sum(lq) / len(lq) for g in groups for lq in g.sampler_logps], dtype=torch.float64)
        group_ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.completion_ids])
        rewards = torch.tensor([r for g in groups for r in g.rewards], dtype=torch.float64)
        w = torch.exp(seq_logq - gepo_log_expectation(seq_logq, group_ids)).tolist()
        adv = group_advantages(rewards, group_ids).tolist()
        mins = [min(w[i * 8:(i + 1) * 8]) for i in range(len(groups))]
        maxs = [max(w[i * 8:(i + 1) * 8]) for i in range(len(groups))]
        positive = [x for x, a in zip(w, adv) if a > 0]
        negative = [x for x, a in zip(w, adv) if a < 0]
        q = sorted(w)
        out["settings"][name] = {
            "weight_p01": q[int(0.01 * len(q))], "weight_median": statistics.median(q), "weight_p99": q[int(0.99 * len(q))],
            "weight_min": q[0], "weight_max": q[-1],
            "median_of_group_min": statistics.median(mins), "median_of_group_max": statistics.median(maxs),
            "share_outside_clip": sum(not 0.8 <= x <= 1.2 for x in w) / len(w),
            "completions_with_positive_advantage": len(positive),
            "share_of_them_without_gradient": sum(x > 1.2 for x in positive) / max(1, len(positive)),
            "completions_with_negative_advantage": len(negative),
            "share_of_them_without_gradient_neg": sum(x < 0.8 for x in negative) / max(1, len(negative)),
            "reward_mean": float(rewards.mean()),
            "mean_completion_tokens": sum(len(c) for g in groups for c in g.completion_ids) / len(w),
        }
        print(name, json.dumps(out["settings"][name], indent=1))
    (Path(__file__).parent / "gepo_weights.json").write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
