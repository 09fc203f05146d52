"""What trust costs the learner at demo scale: signing and verifying rollouts, and the
content checks, against the learner's own optimizer step, measured side by side.

    python bench/signing.py [--steps K] [--groups N]

One process, one batch of real groups: the demo's model shape (built-in tiny model, random
init, seeded) samples `groups` prompts x 8 completions of the demo task. Then, per group:

- sign:   `seal_rollout` (what a sampler adds per group);
- verify: `RolloutVerifier.check` (decode + Ed25519 verification + registry lookup; what
          the learner adds per message);
- checks: `GroupScreen.check` at staleness 0 (re-scoring the rewards with the verifier and,
          the key being on probation, recomputing the log-probs with the learner's weights:
          what a re-scored group costs; after probation a fresh group is checked by the step's
          own forward passes, at no cost of its own, and a drawn stale one in a batched pass);
- step:   `optimizer_step` on a DeepSpeed engine with the demo's learner settings, per group
          of a `groups`-group batch (what the learner does anyway).

Targets (issue 13): what signatures add is <= 5 %: verification minus the decoding the
learner did anyway, against its per-group step time; signing against the sampler's
per-group generation time. Exit status 1 if missed. The content checks are reported
beside them (no target: they are the price of not trusting rewards and log-probs,
docs/security.md).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 0.05


def per_item(fn, items, repeats: int = 3) -> float:
    """Median over `repeats` passes of the seconds per item."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - t0) / len(items))
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=64, help="groups per learner step (demo: 64)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (after one warm-up)")
    args = parser.parse_args(argv)

    import torch

    from consumers.screening import GroupScreen
    from pipeline.config import load_config
    from pipeline.learning.engine import make_deepspeed_engine
    from pipeline.models import sample_groups
    from pipeline.models.tiny import ModelSize, build_tiny_model, build_tokenizer
    from pipeline.wire.rollout import decode_rollout, encode_rollout, seal_rollout
    from pipeline.wire.signing import SigningKey
    from pipeline.tasks import make_task
    from pipeline.trust import KeyEntry, KeyRegistry, RolloutVerifier
    from pipeline.learning.update import optimizer_step
    from producers.sampler import score_groups

    torch.set_num_threads(1)
    cfg = load_config(str(ROOT / "heterorl/configs/demo.yaml"), [])
    m, s = cfg.model, cfg.sampler
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, ModelSize(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size,
                                                  m.max_positions, m.head_dim), seed=0)
    task = make_task("arithmetic", digits=cfg.task.digits, ops=cfg.task.ops)
    problems = [task.train_problem(i) for i in range(args.groups)]
    groups = sample_groups(model, tokenizer, [task.encode_prompt(p, tokenizer) for p in problems],
                           group_size=s.group_size, temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=0)
    rollouts = score_groups(task, tokenizer, problems, groups, sampler_id="bench", policy_version=0,
                            sampling={"temperature": s.temperature})
    key = SigningKey.generate()
    for i, r in enumerate(rollouts):
        r.run, r.key_id, r.seq = "bench", key.key_id, i
    registry = KeyRegistry.empty("bench").with_key(
        KeyEntry(key.key_id, "bench", key.public, "active", time.time() + 3600, time.time()))

    t0 = time.perf_counter()
    sample_groups(model, tokenizer, [task.encode_prompt(p, tokenizer) for p in problems], group_size=s.group_size,
                  temperature=s.temperature, max_new_tokens=s.max_new_tokens, seed=1)
    generate_s = (time.perf_counter() - t0) / len(problems)
    sign_s = per_item(lambda r: seal_rollout(r, key), rollouts)
    sealed = [seal_rollout(r, key) for r in rollouts]
    plain = [encode_rollout(r) for r in rollouts]

    def verify(value):
        RolloutVerifier("bench", registry).check(value, time.time())  # a fresh one: no sequence seen yet

    verify_s = per_item(verify, sealed)
    decode_s = per_item(decode_rollout, plain)  # what the learner did per message before signatures
    no_logprobs = cfg.security.model_copy(update={"stale_check_fraction": 0.0})
    rescore = GroupScreen(no_logprobs, task, tokenizer, s.temperature, lambda: None, None)
    rescore_s = per_item(lambda r: rescore.check(r, staleness=0), rollouts)
    screen = GroupScreen(cfg.security, task, tokenizer, s.temperature, lambda: model, None)
    checks_s = per_item(lambda r: screen.check(r, staleness=0), rollouts)

    engine = make_deepspeed_engine(model, cfg.learner, torch.device("cpu"))
    step = lambda: optimizer_step(engine, rollouts, [1.0] * len(rollouts), cfg.learner,  # noqa: E731
                                  temperature=s.temperature, max_completion_length=s.max_new_tokens)
    step()  # warm-up
    step_times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        step_times.append(time.perf_counter() - t0)
    step_s = statistics.median(step_times) / len(rollouts)

    learner_share = (verify_s - decode_s) / step_s
    sampler_share = sign_s / generate_s
    print(f"demo shape, {len(rollouts)} groups x {s.group_size} completions, one CPU thread, per group:")
    print(f"  learner step          {step_s * 1e3:8.3f} ms   (median of {args.steps} steps / {len(rollouts)} groups)")
    print(f"  sampler generation    {generate_s * 1e3:8.3f} ms")
    print(f"  sign (sampler)        {sign_s * 1e3:8.3f} ms   {sampler_share:7.2%} of its generation")
    print(f"  verify (learner)      {verify_s * 1e3:8.3f} ms   decode + Ed25519 + registry; decoding alone "
          f"{decode_s * 1e3:.3f} ms, which the learner did before")
    print(f"  added by verification {(verify_s - decode_s) * 1e3:8.3f} ms   {learner_share:7.2%} of the step")
    print(f"  rewards re-scored     {rescore_s * 1e3:8.3f} ms   {rescore_s / step_s:7.2%} of the step (every group)")
    print(f"  + log-probs checked   {(checks_s - rescore_s) * 1e3:8.3f} ms   {(checks_s - rescore_s) / step_s:7.2%} of "
          "the step (a re-scored group: a key's first groups, and the drawn share of stale ones; "
          "fresh groups after probation: 0, the step's forward checks them)")
    met = learner_share <= TARGET and sampler_share <= TARGET
    print(f"signatures cost the learner {learner_share:.2%} of its step and the sampler {sampler_share:.2%} of its "
          f"generation (target <= {TARGET:.0%} each): {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
