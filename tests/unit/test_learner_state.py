"""Learner state without pickles: a learner resumed from safetensors + JSON continues exactly,
for every ZeRO stage and precision, and across a change of ZeRO stage."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipeline.config import load_config
from pipeline.learning.engine import make_deepspeed_engine
from pipeline.weights.learner_state import META_FILE, TENSORS_FILE, load_learner_state, save_learner_state

CPU = torch.device("cpu")


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64)).float()


def engine_for(overrides, model=None):
    cfg = load_config(None, ["learner.lr=3e-2", "learner.lr_warmup_steps=3", "learner.weight_decay=0.1",
                             *overrides], env={}).learner
    return make_deepspeed_engine(model or tiny_model(), cfg, CPU)


def train(engine, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 60, (3, 7), generator=g)
        loss = engine(input_ids=ids).logits.float().log_softmax(-1)[..., 5].mean()
        engine.backward(loss, scale_wrt_gas=False)
        engine.step()


def weights(engine):
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def module_copy(engine):
    """A fresh model holding the engine's current weights (what a checkpoint's safetensors hold)."""
    model = tiny_model()
    model.load_state_dict(weights(engine))
    return model


@pytest.mark.parametrize("overrides", [["learner.zero_stage=0"], ["learner.zero_stage=1"], ["learner.zero_stage=2"],
                                       ["learner.zero_stage=3"],
                                       ["learner.zero_stage=1", "learner.precision=bf16"],
                                       ["learner.zero_stage=3", "learner.precision=bf16"]],
                         ids=["zero0", "zero1", "zero2", "zero3", "zero1-bf16", "zero3-bf16"])
def test_a_resumed_learner_continues_exactly(overrides, tmp_path):
    straight = engine_for(overrides)
    train(straight, 4, seed=1)
    train(straight, 3, seed=2)

    first = engine_for(overrides)
    train(first, 4, seed=1)
    save_learner_state(first, tmp_path / "state")
    resumed = engine_for(overrides, model=module_copy(first))
    meta = load_learner_state(resumed, tmp_path / "state")
    assert meta["adam_step"] == 4 and meta["global_steps"] == 4
    train(resumed, 3, seed=2)

    want, got = weights(straight), weights(resumed)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) == 0.0
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == sorted([META_FILE, TENSORS_FILE])


def test_the_state_carries_over_from_one_zero_stage_to_another(tmp_path):
    first = engine_for(["learner.zero_stage=2"])
    train(first, 4, seed=1)
    save_learner_state(first, tmp_path / "state")
    straight_moments = json.loads((tmp_path / "state" / META_FILE).read_text())
    other = engine_for(["learner.zero_stage=0"], model=module_copy(first))
    load_learner_state(other, tmp_path / "state")
    train(other, 2, seed=2)
    train(first, 2, seed=2)
    want, got = weights(first), weights(other)
    assert straight_moments["zero_stage"] == 2
    assert max(float((want[k] - got[k]).abs().max()) for k in want) < 1e-6


@pytest.mark.parametrize("overrides", [["learner.zero_stage=3"], ["learner.zero_stage=3", "learner.precision=bf16"]],
                         ids=["zero3", "zero3-bf16"])
def test_a_zero3_checkpoint_is_a_plain_hugging_face_directory(overrides, tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from pipeline.weights.learner_state import save_weights
    from pipeline.models.tiny import build_tokenizer

    engine = engine_for(overrides)
    train(engine, 2, seed=1)
    save_weights(engine, build_tokenizer(), tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.safetensors")) == ["model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", use_safetensors=True)
    want = weights(engine)
    got = dict(loaded.named_parameters())
    assert set(got) == set(want)
    assert all(torch.equal(got[k].float(), want[k]) for k in want)
    assert isinstance(PreTrainedTokenizerFast.from_pretrained(tmp_path / "ckpt"), PreTrainedTokenizerFast)
