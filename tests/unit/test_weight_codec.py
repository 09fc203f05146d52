"""The weight-delta codec (pipeline/weights/codec.py): exact reconstruction and refusals."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.weights.codec import (Delta, DeltaError, apply_delta, bits, decode_keyframe, describe, encode_delta,
                                    encode_keyframe, tensor_sha256)


def adam_like_step(weights: dict[str, torch.Tensor], lr: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each weight moved by about lr (fp32 arithmetic, cast back to the weight's dtype), as an Adam step moves it."""
    gen = torch.Generator().manual_seed(seed)
    return {name: (w.float() + lr * torch.randn(w.shape, generator=gen).sign()).to(w.dtype)
            for name, w in weights.items()}


def model_weights(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed.weight": (0.02 * torch.randn(512, 64, generator=gen)).to(dtype),
            "layer.0.mlp.weight": (0.05 * torch.randn(128, 64, generator=gen)).to(dtype),
            "layer.0.norm.weight": torch.ones(64, dtype=dtype)}


def assert_bit_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert np.array_equal(bits(got[name]), bits(want[name])), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_an_optimizer_sized_step_is_rebuilt_bit_for_bit(dtype):
    master = model_weights(torch.float32)  # the learner keeps fp32 master weights and publishes them cast
    base = {name: w.to(dtype) for name, w in master.items()}
    new = {name: w.to(dtype) for name, w in adam_like_step(master, lr=1e-6).items()}
    delta = encode_delta(base, new)
    assert_bit_equal(apply_delta(base, delta), new)
    full = sum(t.numel() * t.element_size() for t in new.values())
    if dtype == torch.bfloat16:
        # A step of 1e-6 moves few master weights across a bf16 rounding boundary: the delta is a small part.
        changed = sum(e["changed"] for e in delta.entries.values()) / sum(t.numel() for t in new.values())
        assert changed < 0.05
        assert delta.nbytes < 0.10 * full
    else:
        # In fp32 nearly every element changes, in its low bits: every step sent (dense) compresses well.
        assert all(e["encoding"] == "dense" for name, e in delta.entries.items() if e["changed"])
        assert delta.nbytes < full


def test_an_unchanged_tensor_costs_nothing_and_one_changed_everywhere_is_exact():
    base = model_weights(torch.bfloat16)
    new = dict(base)
    new["layer.0.mlp.weight"] = torch.randn(128, 64).to(torch.bfloat16)  # every element replaced
    delta = encode_delta(base, new)
    assert delta.entries["embed.weight"]["encoding"] == "same"
    assert delta.entries["embed.weight"]["parts"] == {}
    assert delta.entries["layer.0.norm.weight"]["encoding"] == "same"
    assert not any(key.startswith("embed.weight") for key in delta.payload)
    assert delta.entries["layer.0.mlp.weight"]["changed"] > 0.99 * 128 * 64
    assert_bit_equal(apply_delta(base, delta), new)


def test_special_bit_patterns_survive():
    base = {"w": torch.tensor([0.0, 1.0, -1.0, 2.0, 3.0, 4.0], dtype=torch.float32)}
    new = {"w": torch.tensor([-0.0, float("nan"), float("inf"), float("-inf"), 1e-45, 4.0], dtype=torch.float32)}
    rebuilt = apply_delta(base, encode_delta(base, new))
    assert_bit_equal(rebuilt, new)
    assert delta_entry_changed(base, new) == 5


def test_a_keyframe_travels_packed_and_rebuilds_bit_for_bit():
    """A whole model as a keyframe carries it: bf16 weights of a model's scale take well under
    their bytes (the high byte plane is sign and exponent), every bit pattern survives, and a
    tampered payload, a size other than its words' or another encoding is refused."""
    weights = {**model_weights(torch.bfloat16),
               "odd": torch.tensor([-0.0, float("nan"), float("inf"), float("-inf"), 1e-45, 4.0]),
               "scalar": torch.tensor(2.5, dtype=torch.float16), "empty": torch.zeros(0, 3, dtype=torch.bfloat16)}
    packed = encode_keyframe(weights)
    assert {e["encoding"] for e in packed.entries.values()} == {"words"}
    assert_bit_equal(decode_keyframe(packed), weights)
    gaussian = {k: weights[k] for k in ("embed.weight", "layer.0.mlp.weight")}
    raw = sum(t.numel() * t.element_size() for t in gaussian.values())
    assert encode_keyframe(gaussian).nbytes < 0.8 * raw
    assert_bit_equal(apply_delta(adam_like_step(weights, 1e-2), packed), weights)  # any base: words replace it

    tampered = encode_keyframe(weights)
    key = tampered.entries["embed.weight"]["parts"]["words"]
    blob = bytearray(tampered.payload[key])
    blob[len(blob) // 2] ^= 0xFF
    tampered.payload[key] = bytes(blob)
    with pytest.raises(DeltaError, match="does not decompress|sha256|holds"):
        decode_keyframe(tampered)
    resized = encode_keyframe(weights)
    resized.entries["embed.weight"]["shape"] = [512, 65]
    with pytest.raises(DeltaError, match="declares 65536 bytes, 66560 expected"):
        decode_keyframe(resized)
    negative = encode_keyframe(weights)
    negative.entries["embed.weight"]["shape"] = [-512, 64]
    with pytest.raises(DeltaError, match="negative size"):
        decode_keyframe(negative)
    other = encode_keyframe(weights)
    other.entries["odd"]["encoding"] = "dense"
    with pytest.raises(DeltaError, match="a keyframe holds words, not 'dense'"):
        decode_keyframe(other)


def delta_entry_changed(base, new) -> int:
    return encode_delta(base, new).entries["w"]["changed"]


def test_sparse_is_chosen_when_few_elements_change():
    base = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    where = torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:100]
    new["w"][where] = torch.randn(100, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    delta = encode_delta(base, new)
    assert delta.entries["w"]["encoding"] == "sparse" and delta.entries["w"]["changed"] == 100
    assert delta.nbytes < 1000
    assert_bit_equal(apply_delta(base, delta), new)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_heads(tied):
    """A tied head is one tensor under two names: both rebuild, and stay equal when tied."""
    base = model_weights(torch.bfloat16)
    base["lm_head.weight"] = base["embed.weight"] if tied else base["embed.weight"].clone() * 2
    new = adam_like_step(base, lr=1e-2)
    if tied:
        new["lm_head.weight"] = new["embed.weight"]
    rebuilt = apply_delta(base, encode_delta(base, new))
    assert_bit_equal(rebuilt, new)
    assert torch.equal(rebuilt["lm_head.weight"], rebuilt["embed.weight"]) == tied


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), share=st.floats(0.0, 1.0), dtype=st.sampled_from(["bf16", "fp32"]),
       n=st.integers(1, 3000))
def test_any_change_pattern_round_trips(seed, share, dtype, n):
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(seed)
    base = {"w": torch.randn(n, generator=gen).to(torch_dtype)}
    mask = torch.rand(n, generator=gen) < share
    new = {"w": torch.where(mask, torch.randn(n, generator=gen).to(torch_dtype), base["w"])}
    delta = encode_delta(base, new)
    assert delta.entries["w"]["sha256"] == tensor_sha256(new["w"])
    assert_bit_equal(apply_delta(base, delta), new)


def test_describe_names_what_a_keyframe_reader_checks():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert describe(t) == {"dtype": "fp32", "shape": [2, 3],
                           "sha256": hashlib.sha256(t.numpy().tobytes()).hexdigest()}


# --- refusals: a delta that cannot rebuild exactly what it claims is never loaded ---------------

def a_delta():
    base = model_weights(torch.bfloat16)
    new = adam_like_step(base, lr=1e-2, seed=1)
    return base, new, encode_delta(base, new)


def test_a_tampered_payload_is_refused():
    base, _, delta = a_delta()
    key = next(iter(delta.payload))
    blob = bytearray(delta.payload[key])
    blob[len(blob) // 2] ^= 0xFF
    delta.payload[key] = bytes(blob)
    with pytest.raises(DeltaError, match="does not decompress|sha256|holds"):
        apply_delta(base, delta)


def test_a_payload_rebuilt_against_another_base_is_refused():
    base, _, delta = a_delta()
    other_base = adam_like_step(base, lr=1e-2, seed=7)
    with pytest.raises(DeltaError, match="sha256 .* the manifest says"):
        apply_delta(other_base, delta)


def test_a_missing_base_tensor_or_payload_is_refused():
    base, _, delta = a_delta()
    partial = {k: v for k, v in base.items() if k != "embed.weight"}
    with pytest.raises(DeltaError, match="does not fit its base model.*embed.weight"):
        apply_delta(partial, delta)
    delta.payload.pop(next(iter(delta.payload)))
    with pytest.raises(DeltaError, match="payload is missing"):
        apply_delta(base, delta)


def test_a_wrong_shape_dtype_or_encoding_is_refused():
    base, _, delta = a_delta()
    with pytest.raises(DeltaError, match="the base holds"):
        apply_delta({**base, "embed.weight": base["embed.weight"].float()}, delta)
    delta.entries["embed.weight"]["encoding"] = "pickle"
    with pytest.raises(DeltaError, match="unknown delta encoding 'pickle'"):
        apply_delta(base, delta)
    with pytest.raises(DeltaError, match="different tensors"):
        encode_delta(base, {**base, "extra.weight": torch.zeros(2)})


def test_payloads_are_bounded_by_the_declared_size():
    """A forged payload that expands past the entry's size, or indices past the tensor's end, is refused."""
    base = {"w": torch.zeros(100_000, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    new["w"][torch.randperm(100_000, generator=torch.Generator().manual_seed(0))[:100]] = 1.0
    delta = encode_delta(base, new)
    assert delta.entries["w"]["encoding"] == "sparse"
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    delta.payload[delta.entries["w"]["parts"]["steps"]] = bomb
    with pytest.raises(DeltaError, match="declares 10000000 bytes, 200 expected"):  # refused before it expands
        apply_delta(base, delta)
    undeclared = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 200)
    delta.payload[delta.entries["w"]["parts"]["steps"]] = undeclared
    with pytest.raises(DeltaError, match="declares no size"):
        apply_delta(base, delta)
    for claimed in (0, 100_001):  # no changed element, or more than the tensor holds
        lying = encode_delta(base, new)
        lying.entries["w"]["changed"] = claimed
        with pytest.raises(DeltaError, match=f"claims {claimed} changed elements of 100000"):
            apply_delta(base, lying)
    forged = Delta(entries={"w": {**encode_delta(base, new).entries["w"]}}, payload=dict(encode_delta(base, new).payload))
    forged.payload[forged.entries["w"]["parts"]["indices"]] = zstandard.ZstdCompressor().compress(
        np.array([200_000] + [1] * 99, dtype=np.uint32).tobytes())
    with pytest.raises(DeltaError, match="outside the tensor"):
        apply_delta(base, forged)


# --- the weight path's pure decisions (pipeline/weights/store.py) -----------------------------

def test_a_keyframe_every_n_versions_or_when_the_chain_outweighs_a_full_copy():
    from pipeline.weights.policy import DELTA, KEYFRAME, KeyframeRule

    rule = KeyframeRule(keyframe_every=4)
    assert [rule.choose(n, 10 * n, 10, 1000) for n in range(4)] == [DELTA, DELTA, DELTA, KEYFRAME]
    assert rule.choose(1, 600, 500, 1000) == KEYFRAME  # 600 + 500 >= a full copy of 1000
    assert KeyframeRule(keyframe_every=1).choose(0, 0, 1, 1000) == KEYFRAME


def test_a_sampler_takes_the_cheaper_path_to_a_version():
    from pipeline.weights.store import CorruptCheckpointError
    from pipeline.weights.policy import DELTA, KEYFRAME, Link, choose_path

    chain = [Link(10, KEYFRAME, None, 1000), Link(11, DELTA, 10, 30), Link(12, DELTA, 11, 30), Link(13, DELTA, 12, 30)]
    assert [link.version for link in choose_path(chain, have=12)] == [13]
    assert [link.version for link in choose_path(chain, have=10)] == [11, 12, 13]
    assert [link.version for link in choose_path(chain, have=None)] == [10, 11, 12, 13]
    assert [link.version for link in choose_path(chain, have=7)] == [10, 11, 12, 13]  # not on this chain
    assert choose_path(chain, have=13) == []  # already there
    assert [link.version for link in choose_path(chain[2:], have=11)] == [12, 13]  # read_chain stops after have
    heavy = [Link(10, KEYFRAME, None, 100), Link(11, DELTA, 10, 80), Link(12, DELTA, 11, 80)]
    assert [link.version for link in choose_path(heavy, have=11)] == [12]  # 80 <= 100 + 160
    with pytest.raises(CorruptCheckpointError, match="keyframe"):
        choose_path(chain[1:], have=None)


def test_a_keyframe_is_held_for_slow_joiners_until_long_enough_after_the_next():
    from pipeline.weights.policy import DELTA, KEYFRAME, held_keyframe

    published = [{"version": 0, "kind": KEYFRAME, "at": 0.0}, {"version": 1, "kind": DELTA, "at": 10.0},
                 {"version": 10, "kind": KEYFRAME, "at": 100.0}, {"version": 11, "kind": DELTA, "at": 110.0},
                 {"version": 20, "kind": KEYFRAME, "at": 200.0}]
    assert held_keyframe(published, now=250.0, keep_s=600.0) == 0  # v10 came 150 s ago: v0 still held
    assert held_keyframe(published, now=750.0, keep_s=600.0) == 10  # v0 let go; v20 came 550 s ago
    assert held_keyframe(published, now=801.0, keep_s=600.0) is None  # only the newest keyframe's chain
    assert held_keyframe(published, now=250.0, keep_s=0.0) is None
    assert held_keyframe(published[:2], now=11.0, keep_s=600.0) is None  # one keyframe: nothing superseded
    more = published + [{"version": 30, "kind": KEYFRAME, "at": 300.0}]
    assert held_keyframe(more, now=310.0, keep_s=600.0) == 10  # two held at most, besides the newest


def test_a_bf16_step_costs_little_more_than_a_byte_per_changed_element():
    """Gaps and steps in byte planes: the high planes of a one-step change are zeros (whole
    words cost 2.75 bytes per changed element here; byte planes with the XOR of old and new
    1.25, with zigzag steps 1.09)."""
    from pipeline.weights.codec import byte_planes, from_byte_planes

    generator = torch.Generator().manual_seed(3)
    master = torch.randn(2_000_000, generator=generator) * 0.02  # as a fresh Qwen2 layer is initialised
    step = 1e-6 * torch.randn(master.shape, generator=generator).sign()  # Adam's first step: |update| = lr
    base, new = {"w": master.to(torch.bfloat16)}, {"w": (master + step).to(torch.bfloat16)}
    delta = encode_delta(base, new)
    assert delta.entries["w"]["encoding"] == "sparse"
    assert delta.nbytes / delta.entries["w"]["changed"] < 1.15
    assert_bit_equal(apply_delta(base, delta), new)
    words = np.arange(7, dtype=np.uint32) * 0x01020304
    assert np.array_equal(from_byte_planes(byte_planes(words), np.uint32), words)


def test_tensors_encoded_and_rebuilt_by_several_threads_give_the_same_delta():
    base = model_weights(torch.float32)
    new = adam_like_step(base, lr=1e-5)
    one, three = encode_delta(base, new, workers=1), encode_delta(base, new, workers=3)
    assert one.entries == three.entries and one.payload == three.payload
    assert_bit_equal(apply_delta(base, three, workers=3), new)


def test_a_step_that_changes_every_fp32_element_is_sent_dense():
    base = model_weights(torch.float32)
    new = {name: w + 1e-3 for name, w in base.items()}  # every element moves
    delta = encode_delta(base, new)
    assert {e["encoding"] for e in delta.entries.values()} == {"dense"}
    assert_bit_equal(apply_delta(base, delta), new)


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_steps_are_exact_modulo_the_word_and_small_for_either_sign(dtype):
    """A step is new − old of the bit patterns, zigzag-coded: one bf16 step up or down is 2 or 1
    (a single low byte), and every pair of patterns, across signs and the ends of the range,
    comes back exactly."""
    from pipeline.weights.codec import apply_steps, steps

    top = np.iinfo(dtype).max
    old = np.array([0, 5, 5, 0, top, 0x7F, 0x0001, top // 2], dtype=dtype)
    new = np.array([0, 6, 4, top, 0, 0x80, 0x8001 if dtype == np.uint16 else 0x80000001, top // 2 + 1],
                   dtype=dtype)
    coded = steps(old, new)
    assert list(coded[:3]) == [0, 2, 1]  # unchanged, one step up, one step down
    assert coded[3] == 1 and coded[4] == 2  # 0 -> max is -1 modulo the word, max -> 0 is +1
    assert np.array_equal(apply_steps(old.copy(), coded), new)
    generator = np.random.default_rng(0)
    a = generator.integers(0, top, 10_000, dtype=dtype, endpoint=True)
    b = generator.integers(0, top, 10_000, dtype=dtype, endpoint=True)
    assert np.array_equal(apply_steps(a.copy(), steps(a, b)), b)


def test_deltas_of_an_earlier_release_still_rebuild():
    """Versions published before steps replaced XOR (a `sparse` delta with `flips`, an `xor` one)
    rebuild bit for bit: archived runs, replays and `heterorl weights fetch` of them keep working."""
    from pipeline.weights.codec import byte_planes

    compressor = zstandard.ZstdCompressor(level=3)
    base = model_weights(torch.bfloat16)
    new = adam_like_step(base, lr=1e-2, seed=5)
    old_form = Delta()
    for name in base:
        old, now = bits(base[name]), bits(new[name])
        changed = np.flatnonzero(old != now)
        entry = {"dtype": "bf16", "shape": list(new[name].shape), "changed": int(changed.size),
                 "sha256": tensor_sha256(new[name])}
        if name == "embed.weight":
            gaps = np.diff(changed, prepend=0).astype(np.uint32)
            parts = {"indices": byte_planes(gaps), "flips": byte_planes((old ^ now)[changed])}
            entry["encoding"] = "sparse"
        else:
            parts = {"xor": byte_planes(old ^ now)}
            entry["encoding"] = "xor"
        entry["parts"] = {part: f"{name}.{part}" for part in parts}
        old_form.entries[name] = entry
        old_form.payload.update({f"{name}.{part}": compressor.compress(b) for part, b in parts.items()})
    assert_bit_equal(apply_delta(base, old_form), new)
