"""Several learner ranks (gloo, on this CPU): the same batches on 1 rank and on 2 ranks give the
same weights, for ZeRO stages 1 and 3 and micro-batches that differ in number between ranks."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from safetensors.torch import load_file

from pipeline.clients.services import free_port

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from safetensors.torch import save_file
    from pipeline.config import load_config
    from pipeline.learning.engine import Ranks, make_deepspeed_engine
    from pipeline.learning.update import optimizer_step
    from tests.unit.test_learner_state import tiny_model, weights
    from tests.unit.test_update import groups

    ranks = Ranks.from_env()
    cfg = load_config(None, ["learner.zero_stage={stage}", "learner.lr=1e-2", "learner.kl_coef=0.05",
                             "learner.micro_batch_tokens={budget}"], env={{}}).learner
    engine = make_deepspeed_engine(tiny_model(), cfg, torch.device("cpu"), ranks)
    norms = []
    for seed in (2, 3, 4):
        metrics = optimizer_step(engine, groups(n=5, seed=seed), [1.0, 0.5, 1.0, 1.0, 0.25], cfg,
                                 temperature=1.0, max_completion_length=8, ranks=ranks)
        norms.append(float(engine.get_global_grad_norm()))  # AdamW hides a gradient's scale; its norm does not
    final = weights(engine)
    if ranks.leader:
        save_file({{k: v.contiguous() for k, v in final.items()}}, {out!r})
        print("NUMBERS", *norms, metrics["loss"])
""")


def run(tmp_path, world: int, stage: int, budget: int) -> tuple[dict, list[float]]:
    out = tmp_path / f"w{world}-z{stage}-b{budget}.safetensors"
    script = SCRIPT.format(root=str(ROOT), stage=stage, budget=budget, out=str(out))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    line = next(line for line in outputs[0][0].splitlines() if line.startswith("NUMBERS"))
    return load_file(str(out)), [float(x) for x in line.split()[1:]]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The reference: 1 rank, ZeRO 1, every batch in one pass (that micro-batches and ZeRO 3
    give the one-pass step on one rank is tests/unit/test_update.py and test_learner_state.py)."""
    return run(tmp_path_factory.mktemp("one-rank"), 1, 1, 100_000)


@pytest.mark.parametrize("stage, budget", [(1, 100_000), (3, 12)], ids=["zero1", "zero3-micro"])
def test_two_ranks_give_the_weights_of_one(tmp_path, one_rank, stage, budget):
    one, numbers_one = one_rank
    two, numbers_two = run(tmp_path, 2, stage, budget)
    # Equal but for float32 summation order across ranks, carried through three AdamW steps.
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 3e-5
    # The gradient norm of every step, and the last step's loss.
    assert numbers_two == pytest.approx(numbers_one, rel=1e-4, abs=1e-7)


BF16_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    import torch
    from pipeline.config import load_config
    from pipeline.learning.engine import Ranks, make_deepspeed_engine
    from pipeline.learning.update import optimizer_step
    from pipeline.models import completion_logprobs
    from tests.unit.test_learner_state import tiny_model, weights
    from tests.unit.test_update import groups

    ranks = Ranks.from_env()
    cfg = load_config(None, ["learner.zero_stage=3", "learner.precision=bf16", "learner.half_rounding=dithered",
                             "learner.lr=1e-4", "learner.lr_warmup_steps=0"], env={{}}).learner
    model = tiny_model()
    model.set_attn_implementation("eager")
    engine = make_deepspeed_engine(model, cfg, torch.device("cpu"), ranks)
    for seed in (2, 3, 4):
        optimizer_step(engine, groups(n=5, seed=seed), [1.0] * 5, cfg, temperature=1.0, max_completion_length=8,
                       ranks=ranks)
    batch = groups(n=2, seed=9)
    prompts = [g.prompt_ids for g in batch for _ in g.completion_ids]
    completions = [c for g in batch for c in g.completion_ids]
    engine.module.eval()
    with torch.no_grad():
        computed, _ = completion_logprobs(engine.module, prompts, completions, 1.0)  # every rank: ZeRO 3 gathers
    published = weights(engine)  # what a checkpoint of this version holds
    if ranks.leader:
        fresh = tiny_model()
        fresh.set_attn_implementation("eager")
        fresh.load_state_dict(published)
        for param in fresh.parameters():  # as DeepSpeed's bf16 does: the parameters, not the buffers
            param.data = param.data.to(torch.bfloat16)
        fresh.eval()
        with torch.no_grad():
            again, _ = completion_logprobs(fresh, prompts, completions, 1.0)
        print("SAME" if torch.equal(computed, again) else f"DIFF {{float((computed - again).abs().max())}}")
""")


def test_a_bf16_zero3_learner_on_two_ranks_computes_with_the_weights_it_publishes(tmp_path):
    """Dithered rounding under ZeRO 3 rounds each rank's partition; the small weights DeepSpeed keeps
    gathered must be gathered again from it, or the learner's forward would use other bits than the
    version it publishes (and its samplers' log-probs would part from its own)."""
    script = BF16_SCRIPT.format(root=str(ROOT))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outputs = [p.communicate(timeout=300) for p in procs]
    for p, (_, stderr) in zip(procs, outputs):
        assert p.returncode == 0, stderr[-3000:]
    assert "SAME" in outputs[0][0], outputs[0][0][-500:]
