"""The TRL lane of the race (`bench/async_vs_sync.py --trl`): TRL's `GRPOTrainer`, the library
most users would pick instead, on the same model, prompts, reward, batch shape, learning rate
and schedule, optimizer, precision and threads as the product and the plain loop.

    pip install -e '.[bench-trl]'     # trl and datasets: the bench's, never the product's
    python bench/trl_lane.py --config smollm2 --steps 40 --eval-every 20 --threads 2 --result FILE

The race starts it as a command of its own, so its clock, like the other lanes', starts at its
command's start (imports, the model's load and the base evaluation included). It writes the
loop's result shape (`run_sync` in bench/async_vs_sync.py): each step's time, the held-out
evaluations (the product's own `evaluate_model`, on a copy in the samplers' precision), the
pauses they took, the seconds generating and training.

The same as the other lanes: the base model as the product loads it (`load_policy`, fp32
weights, the learner's attention kernel); the task's train prompts in order, each as the text
of the product's encoded prompt (its chat template); the task's reward; `learner.groups_per_step`
prompts × `sampler.group_size` completions of at most `sampler.max_new_tokens` tokens per step,
one optimizer step per batch; the sampling temperature, top-p and top-k; `learner.lr` with the
product's linear warm-up, step for step (`warmup_factor`); AdamW (0.9, 0.99,
eps 1e-8, `learner.weight_decay`), clipping at `learner.grad_clip`; no KL term; advantages scaled
by the group's std only with `learner.scale_adv_by_std`; `learner.precision` bf16 as TRL does
it on a CPU (autocast over fp32 weights), and `torch_threads` threads.
What differs: TRL's own objective (`loss_type` grpo: the clipped ratio, token means per
sequence), its own generation (`model.generate`) and its Trainer around them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The product's learning-rate schedule, as its DeepSpeed engine applies it (linear WarmupLR,
    `pipeline.learning.engine`): steps 0 and 1 (0-based) at lr/(warmup+1), step k at
    lr·k/(warmup+1), lr from step warmup+1 on."""
    return 1.0 if warmup_steps <= 0 else min(1.0, max(1, step) / (warmup_steps + 1))


def run_trl(cfg, steps: int, threads: int, eval_every: int | None = None) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipeline.devices import resolve_device
    from pipeline.models import DTYPES, load_policy
    from pipeline.runtime import (evaluate_model, learner_attention, make_task_from_config, resolve_base_model,
                                  with_machine_precision)

    torch.set_num_threads(threads)
    device = resolve_device(cfg.model.device)
    cfg, precision = with_machine_precision(cfg, device)
    print(f"  trl: {precision}", file=sys.stderr)
    torch.manual_seed(cfg.run.seed)
    task = make_task_from_config(cfg)
    model, tokenizer = load_policy(resolve_base_model(cfg), device, attention=learner_attention(cfg))
    s, lcfg = cfg.sampler, cfg.learner
    problems = [task.train_problem(i) for i in range(steps * lcfg.groups_per_step)]
    dataset = Dataset.from_dict({"prompt": [tokenizer.decode(task.encode_prompt(p, tokenizer)) for p in problems],
                                 "index": list(range(len(problems)))})

    def reward(prompts, completions, index, **_) -> list[float]:
        return [task.reward(problems[i], completion) for i, completion in zip(index, completions)]

    def evaluate() -> dict:
        model.eval()
        scored = copy.deepcopy(model).to(DTYPES[s.precision])  # as the samplers use the policy
        try:
            with torch.no_grad():
                return evaluate_model(cfg, scored, tokenizer, task)
        finally:
            del scored
            model.train()

    times, evals, pauses = [], [], []
    if eval_every:  # a pause of the clock, as in the loop
        started = time.time()
        evals.append({"step": 0, **evaluate(), "time": started})
        pauses.append((started, time.time()))

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.time())
            print(f"  trl step {state.global_step}/{steps}", file=sys.stderr)
            if eval_every and (state.global_step % eval_every == 0 or state.global_step == steps):
                evals.append({"step": state.global_step, "time": times[-1], **evaluate()})
                pauses.append((times[-1], time.time()))
                print(f"  trl v{state.global_step}: held-out accuracy {evals[-1]['accuracy_sampled']:.3f} "
                      f"(greedy {evals[-1]['accuracy_greedy']:.3f})", file=sys.stderr)

    optimizer = torch.optim.AdamW(model.parameters(), lr=lcfg.lr, betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=lcfg.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: warmup_factor(k, lcfg.lr_warmup_steps))
    with tempfile.TemporaryDirectory(prefix="trl-lane-") as out:
        args = GRPOConfig(
            output_dir=out, max_steps=steps, per_device_train_batch_size=lcfg.groups_per_step * s.group_size,
            gradient_accumulation_steps=1, num_generations=s.group_size, max_completion_length=s.max_new_tokens,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, beta=0.0, loss_type="grpo",
            scale_rewards="group" if lcfg.scale_adv_by_std else "none", max_grad_norm=lcfg.grad_clip,
            bf16=lcfg.precision == "bf16", use_cpu=device.type == "cpu", shuffle_dataset=False, seed=cfg.run.seed,
            logging_steps=1, save_strategy="no", report_to="none", dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                              processing_class=tokenizer, optimizers=(optimizer, schedule), callbacks=[Clock()])
        started = time.time()
        trainer.train()
    evaluating = sum(b - a for a, b in pauses if a >= started)
    return {"times": times, "evals": evals, "pauses": pauses, "precision": precision,
            "seconds": {"time_train_and_generate_s": time.time() - started - evaluating,
                        "time_evaluate_s": evaluating}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="smollm2", help="run config: a built-in name or a file")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--eval-every", type=int, metavar="K", help="held-out accuracy before step 1 and every K steps")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override (repeatable)")
    parser.add_argument("--result", metavar="FILE", required=True, help="where the lane's result goes (JSON)")
    args = parser.parse_args()
    try:
        import trl  # noqa: F401 - said plainly before anything is loaded
    except ImportError:
        print("the TRL lane needs trl: pip install -e '.[bench-trl]'", file=sys.stderr)
        return 2

    from heterorl.config_files import config_path
    from pipeline.config import load_config

    cfg = load_config(str(config_path(args.config).resolve()), args.overrides)
    Path(args.result).write_text(json.dumps(run_trl(cfg, args.steps, args.threads, args.eval_every)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
