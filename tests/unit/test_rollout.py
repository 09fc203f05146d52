"""The rollout wire format: exact round trip, and a clear reason for every bad message."""

import msgpack
import numpy as np
import pytest

from pipeline.wire.rollout import SCHEMA_VERSION, Rollout, RolloutDecodeError, decode_rollout, encode_rollout, header_value


def make_rollout(**over) -> Rollout:
    fields = dict(prompt_id="arith-train-7", task="arithmetic", sampler_id="host-1-abc", policy_version=3,
                  prompt_ids=[1, 5, 6, 7], completion_ids=[[8, 9, 2], [8, 2], [2]],
                  sampler_logps=[[-0.5, -1.25, -0.125], [-2.0, -0.0], [-3.5]], rewards=[1.0, 0.0, 0.0],
                  sampling={"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8})
    fields.update(over)
    return Rollout(**fields)


def test_round_trip_is_exact():
    r = make_rollout()
    back = decode_rollout(encode_rollout(r))
    assert back == r  # dataclass equality: every field, ragged completions included
    assert back.group_size == 3


def test_arrays_are_little_endian_raw_bytes_a_foreign_client_can_read():
    """Decode with msgpack + fixed-width reads only, as docs/schema.md tells another language to."""
    r = make_rollout()
    msg = msgpack.unpackb(encode_rollout(r), raw=False)
    assert msg["schema_version"] == SCHEMA_VERSION
    lengths = msg["completion_lengths"]
    assert lengths["dtype"] == "<i4"
    lens = [int.from_bytes(lengths["data"][i:i + 4], "little", signed=True) for i in range(0, len(lengths["data"]), 4)]
    assert lens == [3, 2, 1]
    logps = np.frombuffer(msg["sampler_logps"]["data"], dtype="<f4")
    assert logps.tolist() == [-0.5, -1.25, -0.125, -2.0, -0.0, -3.5]
    assert msg["sampler_logps"]["shape"] == [6]


def test_headers_allow_filtering_without_decoding():
    r = make_rollout()
    h = r.headers()
    assert header_value(h, "policy_version") == "3"
    assert header_value(h, "sampler_id") == "host-1-abc"
    assert header_value(h, "schema_version") == str(SCHEMA_VERSION)
    assert header_value(h, "rollout_id") == r.rollout_id
    assert header_value(h, "missing") is None


def _mutate(**changes) -> bytes:
    msg = msgpack.unpackb(encode_rollout(make_rollout()), raw=False)
    msg.update(changes)
    return msgpack.packb(msg, use_bin_type=True)


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1 not msgpack", "not msgpack"),
    (msgpack.packb([1, 2, 3]), "not a map"),
    (_mutate(schema_version=2), "schema_version 2"),
    (_mutate(policy_version=-1), "negative"),
    (_mutate(policy_version="3"), "policy_version has type str"),
    (_mutate(rewards={"dtype": "<f4", "shape": [2], "data": b"\0" * 8}), "rewards has shape"),
    (_mutate(sampler_logps={"dtype": "<f4", "shape": [6], "data": np.array([0.5] * 6, "<f4").tobytes()}), "<= 0"),
    (_mutate(sampler_logps={"dtype": "<f4", "shape": [6], "data": np.array([np.nan] * 6, "<f4").tobytes()}), "finite"),
    (_mutate(completion_ids={"dtype": "<i4", "shape": [5], "data": b"\0" * 20}), "lengths sum to 6"),
    (_mutate(prompt_ids={"dtype": "<i4", "shape": [4], "data": b"\0" * 3}), "needs 16"),
    (_mutate(prompt_ids={"dtype": "|O", "shape": [1], "data": b"x"}), "unsupported dtype"),
])
def test_malformed_messages_are_refused_with_a_reason(payload, reason):
    with pytest.raises(RolloutDecodeError) as err:
        decode_rollout(payload)
    assert reason in err.value.reason


def test_missing_field_is_named():
    msg = msgpack.unpackb(encode_rollout(make_rollout()), raw=False)
    del msg["rewards"]
    with pytest.raises(RolloutDecodeError, match="missing field rewards"):
        decode_rollout(msgpack.packb(msg, use_bin_type=True))
